"""The Ray Serve application: the deployments and how they are bound together (`build`, over
deployments/config.py's AppConfig): a Decoder deployment (the engine and its batching loop) behind an Ingress
deployment (OpenAI-style HTTP and the Python handle API), beside the one that every ingress
replica shares: Records (the stored responses, and the files and batches of the Batch API, whose
lines it sends back through the ingress's routes). What each replica runs is
deployments/replicas.py; here, each one's resources, scaling and draining.

    serve run deployments.app:build model=path/to/folder     # or cluster/serve.yaml
    handle = serve.get_app_handle("raymuter")
    await handle.generate.remote(GenerateRequest(prompt="Once"))
"""

from ray import serve
from ray.serve.config import RequestRouterConfig

from . import replicas
from .config import AppConfig, app_kind
from .services.routing import ROUTERS

ROUTER_ON_LOOP = {"RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0"}


# Seconds a stopping replica (scaled down, redeployed, its node drained) may take to finish the
# requests it holds before Serve stops it anyway (Serve's default: 20).
DRAIN_SECONDS = 300

# The deployments of each kind of model, the ingress first.
PARTS = {"text": ("Ingress", "Decoder", "Records"),
         "encoder-decoder": ("Ingress", "Decoder", "Encoder", "Records"),
         "vision": ("Ingress", "Decoder", "Vision", "Records")}
# The same with the routes and the decoder in one Server deployment (AppConfig.colocate).
COLOCATED_PARTS = {kind: ("Server", *names[2:]) for kind, names in PARTS.items()}

# The deployments: each replica's class (deployments/replicas.py) with its resources, scaling and
# draining.
Encoder = serve.deployment(ray_actor_options={"num_cpus": 0.25}, max_ongoing_requests=64)(replicas.Encoder)
Vision = serve.deployment(ray_actor_options={"num_cpus": 0.25}, max_ongoing_requests=64)(replicas.Vision)

# One replica: every ingress replica's /v1/responses, /v1/files and /v1/batches read and write the
# same records (a second replica would hold other ones). It takes no CPU of its own: dicts and,
# optionally, folders; the batches' lines are the routes' work (answer_line) and the decoder's. Serve
# runs the response store's (sync) methods on a thread pool, several at once: it takes a lock in
# each. A redeploy that leaves its settings as they are leaves it running where Serve can; a
# replaced one reads its folders again and resumes the batches that had not ended.
Records = serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=4096,
                           num_replicas=1)(replicas.Records)

# The ingress sends a request to the decoder replica that most likely holds its prompt's prefix
# (deployments/services/routing.py); a Serve config's request_router_config replaces it (ROUTERS).
# A replica that is scaled down or replaced by a redeploy takes no new request and finishes the
# rows it holds, up to DRAIN_SECONDS (a long generation at a slow model's pace), so no stream is cut.
Decoder = serve.deployment(ray_actor_options={"num_cpus": 0.5}, max_ongoing_requests=1024, health_check_period_s=2,
                           health_check_timeout_s=10,
                           request_router_config=RequestRouterConfig(request_router_class=ROUTERS["prefix"]),
                           graceful_shutdown_timeout_s=DRAIN_SECONDS, graceful_shutdown_wait_loop_s=1)(replicas.Decoder)

# The ingress's handles route on its own event loop (Serve's default: a router thread, which every
# streamed chunk hopped through); only here, as a handle built outside a running loop (a driver's
# sync `.remote().result()`) needs the router thread. See deployments.cli.environment.SAME_LOOP.
Ingress = serve.deployment(ray_actor_options={"num_cpus": 0.25, "runtime_env": {"env_vars": ROUTER_ON_LOOP}},
                           max_ongoing_requests=1024, graceful_shutdown_timeout_s=DRAIN_SECONDS,
                           graceful_shutdown_wait_loop_s=1)(replicas.HTTPIngress)

# The routes and the decoder in one replica (AppConfig.colocate): the ingress's code over a
# LocalHandle of its own Decoder, so a request and each streamed chunk cost no Ray message.
Server = serve.deployment(ray_actor_options={"num_cpus": 0.5, "runtime_env": {"env_vars": ROUTER_ON_LOOP}},
                          max_ongoing_requests=1024, health_check_period_s=2, health_check_timeout_s=10,
                          graceful_shutdown_timeout_s=DRAIN_SECONDS, graceful_shutdown_wait_loop_s=1,
                          logging_config={"enable_access_log": False})(replicas.Server)

api = replicas.build_api()  # this process's: the OpenAPI document, the routes in process (tests, raymuter batch)


def build(args: dict | None = None):
    """The application (Serve's app builder: `serve run deployments.app:build model=...`)."""
    cfg = AppConfig(**(args or {}))
    return application(cfg, app_kind(cfg))


def application(cfg: AppConfig, kind: str):
    """The deployments of PARTS[kind] (COLOCATED_PARTS[kind] with colocate), bound together (no
    model is read here)."""
    config = cfg.model_dump()
    if cfg.colocate and "ingress" in cfg.autoscaling:
        raise ValueError("autoscaling: with colocate the routes run in the decoder's replicas; "
                         "scale them with autoscaling.decoder, not autoscaling.ingress")
    decoder = Server if cfg.colocate else Decoder  # the Server takes the decoder's resources and autoscaling
    if cfg.gpu == "yes" or (cfg.gpu == "auto" and _cluster_has_gpu()):
        decoder = decoder.options(ray_actor_options={**decoder.ray_actor_options, "num_gpus": 1})
    parts = {"ingress": Ingress, "decoder": decoder, "encoder": Encoder, "vision": Vision}
    for part, settings in cfg.autoscaling.items():
        parts[part] = parts[part].options(autoscaling_config=settings.serve_config(part))
    ingress, decoder = parts["ingress"], parts["decoder"]
    encoder = parts["encoder"].bind(config) if kind == "encoder-decoder" else None
    vision = parts["vision"].bind(config) if kind == "vision" else None
    # records "server" (colocate only): the Server's replica makes its own (replicas.Server)
    records = None if cfg.records == "server" else Records.bind(replicas.records_settings(cfg))
    if cfg.colocate:
        return decoder.bind(config, encoder, vision, records)
    return ingress.bind(decoder.bind(config, encoder), config, encoder, vision, records)


def _cluster_has_gpu() -> bool:
    import ray

    try:
        return ray.is_initialized() and ray.cluster_resources().get("GPU", 0) >= 1
    except Exception:  # noqa: BLE001 - no cluster to ask: plan for CPU
        return False
