"""The multi-turn chat workload: a shared system prompt, conversations started open-loop, each
turn's prompt the conversation so far plus a new question; bad shapes refused before anything
is sent."""

from __future__ import annotations

import pytest

from orchestrator.cli.main import main
from orchestrator.loadgen.conversations import build_conversations, parse_multiturn
from orchestrator.loadgen.requests import document_specs


def test_conversations_share_the_system_prompt_and_are_repeatable() -> None:
    shape = parse_multiturn(
        "multiturn:4:3", system_tokens=40, question_tokens=(5, 9), rate=2.0, seed=7
    )
    system, conversations = build_conversations(shape, vocab_size=100, excluded_ids=[0, 1])
    assert len(system) == 40 and not {0, 1} & set(system)
    assert [c.index for c in conversations] == [0, 1, 2, 3]
    starts = [c.start_s for c in conversations]
    assert starts[0] == 0.0 and starts == sorted(starts)
    for conversation in conversations:
        assert len(conversation.questions) == 3 and conversation.answers == (32, 32, 32)
        assert all(5 <= len(q) <= 9 and not {0, 1} & set(q) for q in conversation.questions)
    assert build_conversations(shape, 100, [0, 1]) == (system, conversations)
    fixed = parse_multiturn("multiturn:3:2", rate=4.0, arrival="fixed")
    assert [c.start_s for c in build_conversations(fixed, 100)[1]] == [0.0, 0.25, 0.5]


def test_the_conversations_sent_are_the_simulators_turns() -> None:
    """Starts, question and answer lengths come from the simulator's workload, so a measured
    run and its simulation (`bench validate`) have the same request list."""
    shape = parse_multiturn("multiturn:5:4", system_tokens=30, question_tokens=(3, 11), seed=2)
    system, conversations = build_conversations(shape, vocab_size=50)
    specs = shape.requests()
    for conversation in conversations:
        turns = specs[conversation.index * 4 : (conversation.index + 1) * 4]
        assert conversation.start_s == turns[0].arrival_time
        prompt = len(system)
        for question, answer, spec in zip(
            conversation.questions, conversation.answers, turns, strict=True
        ):
            prompt += len(question)
            assert (prompt, answer) == (spec.num_prompt_tokens, spec.num_output_tokens)
            prompt += answer


def _compare(*flags: str) -> list[str]:
    # Configs that do not exist: a refusal must come before they are read.
    return ["bench", "compare", "--disaggregated", "/nonexistent/d.yaml",
            "--colocated", "/nonexistent/c.yaml", "--prompt", "multiturn:2:3", *flags]  # fmt: skip


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--num-requests", "6"], "--num-requests: a multiturn workload sends"),
        (["--prefix-hit", "0.5"], "--prefix-hit: a multiturn workload's hits come from"),
        (["--duration", "10"], "--duration: a multiturn workload sends"),
        (["--backend", "http"], "a multiturn workload runs over the grpc backend only"),
        (["--warmup", "6"], "warm-up must be in [0, 6)"),
        (["--question-tokens", "9-x"], "--question-tokens: expected N or A-B"),
    ],
)
def test_compare_refuses_a_bad_multiturn_run_before_starting_a_cluster(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(_compare(*flags)) == 2
    assert message in capsys.readouterr().err


def test_multiturn_flags_need_a_multiturn_prompt_and_a_sweep_refuses_one(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = _compare("--system-tokens", "64")
    argv[argv.index("multiturn:2:3")] = "fixed:64"
    assert main(argv) == 2
    assert "--system-tokens: only with --prompt multiturn:C:T" in capsys.readouterr().err
    sweep = ["bench", "sweep", "--disaggregated", "/nonexistent/d.yaml", "--colocated",
             "/nonexistent/c.yaml", "--rates", "0.5,1", "--prompt", "multiturn:2:3"]  # fmt: skip
    assert main(sweep) == 2
    assert "a sweep runs open-loop requests" in capsys.readouterr().err


def test_a_saved_multiturn_run_is_simulated_as_it_was_sent() -> None:
    flags = {"rate": 0.5, "arrival": "poisson", "num_requests": None, "duration": None,
             "prompt": "multiturn:3:4", "output": "fixed:16", "seed": 5, "prefix_hit": 0.0,
             "warmup": 4, "system_tokens": 128, "question_tokens": "8-16",
             "think_time": None}  # fmt: skip
    specs, num_warmup = document_specs({"workload": flags})
    sent = parse_multiturn("multiturn:3:4", system_tokens=128, question_tokens=(8, 16),
                           output_tokens=16, rate=0.5, seed=5)  # fmt: skip
    assert num_warmup == 4 and specs == sent.requests()
    assert [s.follows for s in specs[:4]] == [-1, 0, 1, 2]


@pytest.mark.parametrize(
    ("spec", "options"),
    [
        ("uniform:1-2", {}),
        ("multiturn:4", {}),
        ("multiturn:x:3", {}),
        ("multiturn:0:3", {}),
        ("multiturn:4:3", {"question_tokens": (9, 5)}),
        ("multiturn:4:3", {"rate": 0.0}),
        ("multiturn:4:3", {"arrival": "burst"}),
    ],
)
def test_bad_shapes_are_refused(spec: str, options: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        parse_multiturn(spec, **options)


def test_the_command_refuses_a_bad_shape_before_it_connects(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # No router listens there: the refusal must come first.
    argv = ["bench", "multiturn", "--address", "127.0.0.1:9", "--question-tokens", "9-x"]
    assert main(argv) == 2
    assert "--question-tokens" in capsys.readouterr().err
