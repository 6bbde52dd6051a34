# learner, rollout (hf engine), evaluator, and topology local_sgd's trainer and aggregator: CPU torch
# by default; for a CUDA build pass an index of download.pytorch.org that has torch 2.13.0,
# e.g. --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128
FROM python:3.11.14-slim-bookworm
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
# models and the demo model land in /cache, the volume the deploy files mount there
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 BRIGADE_LOG_FORMAT=json \
    BRIGADE_CACHE=/cache HF_HOME=/cache/huggingface
WORKDIR /app
COPY constraints.txt deploy/docker/requirements.py ./
# torch first, from its own index, at the version constraints.txt pins
RUN pip install -c constraints.txt --index-url ${TORCH_INDEX} torch
# Third-party dependencies next, from the pyproject files alone: a code change reuses this layer.
COPY libs/brigade/pyproject.toml libs/brigade/
COPY libs/brigade_cli/pyproject.toml libs/brigade_cli/
COPY libs/brigade_harness/pyproject.toml libs/brigade_harness/
COPY services/learner/pyproject.toml services/learner/
COPY services/rollout/pyproject.toml services/rollout/
COPY services/evaluator/pyproject.toml services/evaluator/
COPY services/aggregator/pyproject.toml services/aggregator/
RUN python requirements.py "libs/brigade[ml,hf]" "libs/brigade_cli[plots]" libs/brigade_harness services/learner services/rollout \
      services/evaluator services/aggregator > requirements.txt \
 && pip install -c constraints.txt -r requirements.txt
# Then the code itself, with no dependency left to resolve.
COPY libs/brigade libs/brigade
COPY libs/brigade_cli libs/brigade_cli
COPY libs/brigade_harness libs/brigade_harness
COPY services/learner services/learner
COPY services/rollout services/rollout
COPY services/evaluator services/evaluator
COPY services/aggregator services/aggregator
RUN pip install --no-deps -c constraints.txt ./libs/brigade ./libs/brigade_cli ./libs/brigade_harness ./services/learner \
      ./services/rollout ./services/evaluator ./services/aggregator
# a named volume mounted on /cache starts with this owner
RUN useradd --system --uid 10001 --create-home --home-dir /home/brigade brigade \
 && mkdir -p /cache/huggingface && chown -R brigade /cache
USER brigade
VOLUME /cache
ENTRYPOINT ["brigade"]
