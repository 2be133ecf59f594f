# syntax=docker/dockerfile:1
# gpupool's image: the router (`gpupool serve`, the default command) and, in the same image,
# the vLLM it fronts, so the Helm chart runs one image for the router, the engines and the
# dev-model init container (docs/kubernetes.md, "The image").
#
#   CUDA: docker build --build-arg VARIANT=cuda -t ghcr.io/gpupool/gpupool:0.1.0 .
#   CPU:  docker build --build-arg VARIANT=cpu  -t ghcr.io/gpupool/gpupool:0.1.0-cpu .
#   podman build / buildah bud take the same arguments.
#
# Stages: `wheel` builds gpupool's wheel (pure Python) in a slim Python image; `image` installs
# it with its dependencies on top of vLLM's official OpenAI-server image (cuda) or its CPU image
# (cpu), whose vLLM, torch and CUDA stay as they are (the installer keeps what already
# satisfies gpupool's ranges). It runs as an unprivileged user (uid 10001, the chart's
# runAsUser) and writes only under /data (the working directory: ./.gpupool/ledger.sqlite and
# the rest) and /tmp. tests/integration/test_image_real.py builds the cpu variant and starts
# the router from it against a real engine.

ARG VARIANT=cuda
ARG PYTHON_IMAGE=docker.io/library/python:3.12-slim
ARG VLLM_IMAGE=docker.io/vllm/vllm-openai:v0.11.0
ARG VLLM_CPU_IMAGE=public.ecr.aws/q9t5s3a7/vllm-cpu-release-repo:v0.11.0

# ------------------------------------------------------------------------------ the wheel
FROM ${PYTHON_IMAGE} AS wheel
WORKDIR /src
COPY pyproject.toml README.md ./
COPY pools pools
COPY router router
COPY gpu_probe gpu_probe
COPY kvcache_model kvcache_model
COPY benchmarks benchmarks
RUN python -m pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

# ------------------------------------------------------------------------------ the image
# VARIANT picks the base: cuda (vLLM's OpenAI server image) or cpu (vLLM's CPU image); only
# the chosen one is pulled
FROM ${VLLM_IMAGE} AS base-cuda
FROM ${VLLM_CPU_IMAGE} AS base-cpu
FROM base-${VARIANT} AS image
ARG VARIANT
COPY --from=wheel /wheels /tmp/wheels
# into vLLM's own Python (the system one, or the venv first on PATH): uv as vLLM's images
# install, pip where uv is absent; NVML readings on CUDA
RUN set -eux; \
    wheel="$(ls /tmp/wheels/gpupool-*.whl)"; \
    if [ "${VARIANT}" = cuda ]; then wheel="${wheel}[nvml]"; fi; \
    if command -v uv >/dev/null; then \
        uv pip install --system --no-cache "${wheel}"; \
    else \
        python3 -m pip install --no-cache-dir "${wheel}"; \
    fi; \
    rm -rf /tmp/wheels; \
    gpupool --help >/dev/null; \
    python3 -c "import vllm, router.gateway.app"; \
    (id -u 10001 >/dev/null 2>&1 || useradd --uid 10001 --create-home --shell /usr/sbin/nologin gpupool); \
    mkdir -p /data /etc/gpupool; chown 10001 /data
USER 10001
WORKDIR /data
ENV PYTHONUNBUFFERED=1
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=3s --start-period=30s \
    CMD python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=2)"
ENTRYPOINT ["gpupool"]
CMD ["serve", "--config", "/etc/gpupool/config.yaml"]
