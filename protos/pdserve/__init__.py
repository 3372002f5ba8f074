"""Protobuf packages of the pdserve API, one subpackage per version (``pdserve.v1``)."""
