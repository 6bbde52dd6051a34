# learner, rollout (hf engine) and evaluator: CPU torch by default; pass
# --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu124 for a CUDA build.
FROM python:3.11-slim
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
WORKDIR /app
RUN pip install --no-cache-dir --index-url ${TORCH_INDEX} "torch>=2.4,<2.14"
COPY libs/brigade libs/brigade
COPY libs/brigade_cli libs/brigade_cli
COPY services/learner services/learner
COPY services/rollout services/rollout
COPY services/evaluator services/evaluator
RUN pip install --no-cache-dir "./libs/brigade[ml]" "./libs/brigade_cli[plots]" \
      ./services/learner ./services/rollout ./services/evaluator
ENV PYTHONUNBUFFERED=1 BRIGADE_LOG_FORMAT=json BRIGADE_CACHE=/cache
VOLUME /cache
ENTRYPOINT ["brigade"]
