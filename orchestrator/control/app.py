"""The served system in one process: Ray (joined or embedded), the control plane, the router and
its gRPC server with health and reflection (TLS / mTLS and token auth per ``router.tls`` /
``router.auth``, `orchestrator.api.security`).

`ServingApp.start()` places every worker group and binds the router; `ServingApp.stop()` drains
(health NOT_SERVING, new requests UNAVAILABLE, running and queued ones finish within
``grace_seconds``), stops the server, then drains and removes the workers, and ends an embedded
Ray. `serve()` wraps both around SIGINT / SIGTERM (`orchestrator.control.shutdown`: a second
signal ends the process at once).

No step of the stop waits on Ray for long: if Ray is gone (a signal to the whole cgroup reached
its processes too, `orchestrator.control.embedded_ray`), the workers are not drained through it
and what is left of an embedded Ray is ended by pid.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from dataclasses import dataclass, field
from typing import Any

from orchestrator.config.cluster import DTYPE_BYTES, ClusterConfig
from orchestrator.control.embedded_ray import (
    EmbeddedRay,
    abandon_ray,
    connect_ray,
    embeds_ray,
    exit_abandoning_ray,
    gcs_answers,
    shutdown_ray,
)
from orchestrator.control.processes import signal_all
from orchestrator.control.shutdown import StopSignals, off_loop
from workers.netaddr import join_host_port

logger = logging.getLogger(__name__)

GENERATION_SERVICE = "pdserve.v1.Generation"


@dataclass(frozen=True)
class AppOptions:
    ray_address: str | None = None
    num_cpus: int | None = None  # embedded Ray only
    metrics_port: int | None = None  # serve /metrics of the router when set
    seed: int | None = None
    # The cluster's key as hex (`orchestrator.control.cluster_secret`); None: drawn per cluster.
    # Out of repr: options get logged, secrets must not be.
    cluster_secret: str | None = field(default=None, repr=False)


def router_grpc_server(interceptors: list[Any], max_request_bytes: int) -> Any:
    """The router's grpc.aio server (not started, no port yet)."""
    import grpc

    return grpc.aio.server(
        interceptors=interceptors,
        options=[
            ("grpc.max_concurrent_streams", 4096),
            # Room above router.max_request_bytes, so that a request somewhat too large
            # still reaches the servicer and gets INVALID_ARGUMENT with the limit named.
            ("grpc.max_receive_message_length", 2 * max_request_bytes),
            # gRPC binds with SO_REUSEPORT by default: a second router on the same address
            # would start too and take half the connections; it must fail to bind instead.
            ("grpc.so_reuseport", 0),
        ],
    )


class ServingApp:
    def __init__(
        self,
        config: ClusterConfig,
        options: AppOptions | None = None,
        controller_options: Any = None,
    ) -> None:
        self.config = config
        self.options = options or AppOptions()
        self._controller_options = controller_options
        self._ray: EmbeddedRay | None = None  # the Ray this app started, which it ends
        self.address = ""
        self.controller: Any = None
        self.router: Any = None
        self._server: Any = None
        self._health: Any = None
        self._metrics_server: Any = None
        self._http: Any = None
        self.http_address = ""
        self.metrics_registry: Any = None
        self._tls: Any = None  # orchestrator.api.security.ServerTLS when router.tls is enabled

    async def start(self) -> str:
        """Place the workers and bind the router; returns its ``host:port``."""
        from orchestrator.api.security import load_server_tls
        from orchestrator.control.controller import Controller
        from orchestrator.control.registry import Registry

        # Before anything is placed: a missing or unusable certificate fails here, cheaply.
        if self.config.router.tls.enabled:
            self._tls = load_server_tls(self.config.router.tls)
        # An embedded Ray runs every worker here: a model directory missing here is one line
        # now, not each worker's remote traceback (a joined cluster's hosts may have it).
        if embeds_ray(self.options.ray_address) and not self.config.model.is_dir():
            raise FileNotFoundError(f"model directory {self.config.model} does not exist")
        self._ray = connect_ray(self.options.ray_address, self.options.num_cpus)
        registry = Registry()
        self.controller = Controller(
            self.config, registry, self._controller_options, secret=self.options.cluster_secret
        )
        try:
            await self.controller.start()
            await self._start_router(registry)
        except BaseException:
            await self.stop()
            raise
        return self.address

    async def _start_router(self, registry: Any) -> None:
        from grpc_health.v1 import health, health_pb2, health_pb2_grpc
        from grpc_reflection.v1alpha import reflection
        from prometheus_client import CollectorRegistry

        from orchestrator.api.servicer import GenerationServicer, add_generation_servicer
        from orchestrator.router.core import Router
        from workers.metrics import Metrics, serve_metrics

        config = self.config
        model_info, tokenizer, settings, groups = describe(config, registry, self.options.seed)
        self.metrics_registry = metrics_registry = CollectorRegistry()
        metrics = Metrics(metrics_registry, role="router", model=model_info.model_name)
        if self.options.metrics_port is not None:
            self._metrics_server, _ = serve_metrics(
                metrics_registry, config.router.host, self.options.metrics_port
            )
        self.router = Router(
            settings, registry, tokenizer, metrics, worker_token=self.controller.secret
        )
        servicer = GenerationServicer(
            self.router, model_info, groups, self.controller.refresh, self.scale
        )
        server = router_grpc_server(self._interceptors(), config.router.max_request_bytes)
        add_generation_servicer(servicer, server)
        self._health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        reflection.enable_server_reflection(
            (GENERATION_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), server
        )
        if self._tls is not None:
            port = server.add_secure_port(config.router.address, self._tls.grpc_credentials)
        else:
            port = server.add_insecure_port(config.router.address)
        self._server = server  # `stop` stops it, started or not
        starting = asyncio.ensure_future(server.start())
        try:
            await asyncio.shield(starting)
        except asyncio.CancelledError:
            # Ctrl-C: grpc's start must not be cut short (its serving loop then fails with
            # InvalidStateError) nor the server stopped before it ends (a crash): let it end.
            await starting
            raise
        for name in ("", GENERATION_SERVICE):
            await self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self.address = join_host_port(config.router.host, port)
        logger.info(
            "router serving %s on %s (%s, %s)",
            model_info.model_name,
            self.address,
            self._tls.mode if self._tls is not None else "plaintext",
            "token auth" if config.router.auth.token else "no auth",  # never the token itself
        )
        await self._start_http(model_info.model_name)

    async def scale(self, role: str, replicas: int) -> Any:
        """Give group ``role`` ``replicas`` workers while serving (`Controller.scale`): removed
        ones finish their requests within ``router.grace_seconds`` first."""
        return await self.controller.scale(
            role,
            replicas,
            grace_seconds=self.config.router.grace_seconds,
            in_flight=self.router.in_flight_on,
        )

    def _interceptors(self) -> list[Any]:
        from workers.token_auth import TokenAuthInterceptor

        token = self.config.router.auth.token
        return [TokenAuthInterceptor(token)] if token else []

    async def _start_http(self, model_name: str) -> None:
        from orchestrator.api.http import HttpSettings, OpenAIHttpApi

        where = self.config.router.http_host_port
        if where is None:
            return
        settings = HttpSettings(model_name, self.config.router.auth.token)
        self._http = OpenAIHttpApi(self.router, settings)
        ssl_context = self._tls.ssl_context if self._tls is not None else None
        self.http_address = await self._http.start(*where, ssl_context=ssl_context)
        logger.info("OpenAI HTTP API on %s/v1", self.http_url)

    @property
    def http_url(self) -> str:
        """``http(s)://host:port`` of the HTTP front ("" when it is off)."""
        if not self.http_address:
            return ""
        return f"{'https' if self._tls is not None else 'http'}://{self.http_address}"

    async def stop(self) -> None:
        grace = self.config.router.grace_seconds
        if self.controller is not None:
            self.controller.stop_replacing()
        self._look_at_ray()  # before anything ends: who the workers are
        ray_answers = True
        try:
            if self._health is not None:
                await self._health.enter_graceful_shutdown()
            if self.router is not None:
                await self.router.drain(grace)
            if self._server is not None:
                await self._server.stop(grace)
            if self._http is not None:
                await self._http.stop()
            if self.router is not None:
                await self.router.close()
            if self.controller is not None:
                ray_answers = await self._ray_answers()
                if ray_answers:
                    await self.controller.shutdown(grace)
                else:
                    await self.controller.abandon()
            if self._metrics_server is not None:
                self._metrics_server.shutdown()
                self._metrics_server.server_close()
        finally:
            await self._end_ray(ray_answers)
        logger.info("shutdown complete")

    async def _ray_answers(self) -> bool:
        answers = await off_loop(
            lambda: gcs_answers(RAY_PROBE_SECONDS), RAY_PROBE_SECONDS + 1, "asking Ray's GCS"
        )
        return bool(answers)

    def _worker_pids(self) -> set[int]:
        if self.controller is None:
            return set()
        return {r.pid for r in self.controller.registry.workers.values() if r.pid}

    def _look_at_ray(self) -> None:
        if self._ray is not None:
            self._ray.look(self._worker_pids())

    async def _end_ray(self, ray_answers: bool) -> None:
        """Disconnect from Ray, ending it if this app started it; without waiting on a Ray that
        is gone."""
        import ray

        if self._ray is None:
            if ray_answers or not ray.is_initialized():
                return
            # A joined cluster that no longer answers: ours is only the driver, which cannot
            # disconnect from a GCS that is gone.
            abandon_ray()
            return
        embedded = self._ray
        try:
            if ray_answers and await self._ray_answers():
                if await off_loop(shutdown_ray, RAY_SHUTDOWN_SECONDS, "ray.shutdown") is None:
                    abandon_ray()
            else:
                logger.warning("Ray is gone: ending what is left of it by pid")
                abandon_ray()
            # Anything of ours Ray did not end (a worker whose raylet died first) ends by pid.
            await off_loop(
                lambda: embedded.kill(self._worker_pids()), 10.0, "ending leftover Ray processes"
            )
        finally:
            self._ray = None

    def kill_now(self) -> None:
        """SIGKILL every process of an embedded Ray (workers included), without draining."""
        if self._ray is not None:
            signal_all(self._ray.look(self._worker_pids()), signal.SIGKILL)


RAY_PROBE_SECONDS = 1.0
RAY_SHUTDOWN_SECONDS = 30.0


def describe(config: ClusterConfig, registry: Any, seed: int | None) -> tuple[Any, Any, Any, Any]:
    """Model info, tokenizer, router settings and group views of a started cluster."""
    from orchestrator.api.servicer import GroupView
    from orchestrator.router.types import RouterSettings
    from protos.pdserve.v1 import generation_pb2 as pb
    from workers.engine.model_config import ModelConfig
    from workers.engine.stop_checker import try_load_tokenizer

    model = ModelConfig.from_dir(config.model)
    tokenizer = try_load_tokenizer(config.model)
    role = "decode" if config.is_disaggregated else "mixed"
    engine = config.engine_config(role)
    max_model_len = config.limits.max_model_len or model.max_len
    eos = set(model.eos_token_ids) | set(tokenizer.eos_token_ids if tokenizer else ())
    # A prompt must fit the KV pool of its decode worker and, disaggregated, of its prefill one.
    roles = (role, "prefill") if config.is_disaggregated else (role,)
    pages = min(w.load.num_total_kv_pages for r in roles for w in registry.of_role(r))
    dtype = config.dtype if config.dtype != "auto" else model.torch_dtype
    model_info = pb.GetModelInfoResponse(
        model_name=config.model.name,
        architecture=model.architecture,
        dtype=dtype,
        vocab_size=model.vocab_size,
        max_model_len=max_model_len,
        num_layers=model.num_layers,
        num_kv_heads=model.num_kv_heads,
        page_size=config.page_size,
        eos_token_ids=sorted(eos),
        serving_mode=(
            pb.SERVING_MODE_DISAGGREGATED if config.is_disaggregated else pb.SERVING_MODE_MIXED
        ),
        kv_bytes_per_token=model.kv_page_bytes(1, DTYPE_BYTES.get(dtype, 4)),
        kv_latent=model.is_mla,
    )
    settings = RouterSettings(
        serving_role=role,
        is_disaggregated=config.is_disaggregated,
        vocab_size=model.vocab_size,
        max_model_len=max_model_len,
        pool_tokens=pages * config.page_size,
        capacity_per_worker=engine.max_num_seqs,
        max_queue=config.router.max_queue,
        default_max_tokens=config.router.default_max_tokens,
        policy=config.router.policy,
        seed=seed,
        max_request_bytes=config.router.max_request_bytes,
        prefill_retries=config.router.prefill_retries,
        worker_retries=config.router.worker_retries,
        local_prefill_fallback=config.router.local_prefill_fallback,
        eos_token_ids=frozenset(eos),
        kv_cache_weight=config.router.kv_cache_weight,
        kv_load_weight=config.router.kv_load_weight,
    )
    groups = [GroupView(g.role, g.role, g.replicas, g.tp) for g in config.groups]
    return model_info, tokenizer, settings, groups


async def serve(
    config: ClusterConfig, options: AppOptions | None = None, controller_options: Any = None
) -> int:
    """Start, serve until SIGINT / SIGTERM, drain and stop. Returns the exit status: 0 after the
    drain; a second signal during it ends the process at once with 128 + its number."""
    app = ServingApp(config, options, controller_options)

    def stop_now(signum: int) -> None:
        logger.warning(
            "second signal (%s) while draining: stopping now, without draining",
            StopSignals.name(signum),
        )
        app.kill_now()
        exit_abandoning_ray(128 + signum)

    signals = StopSignals(stop_now)
    await app.start()
    # After start: ray.init installs handlers of its own, which would end the process at once.
    signals.install()
    http = f", OpenAI HTTP on {app.http_url}/v1" if app.http_url else ""
    print(f"pdserve: serving on {app.address}{http} (Ctrl-C to stop)", flush=True)
    try:
        await signals.stopping.wait()
        logger.info("signal received: draining")
    finally:
        await app.stop()
    return 0
