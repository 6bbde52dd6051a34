# learner, rollout (hf engine) and evaluator: CPU torch by default; pass
# --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu124 for a CUDA build.
FROM python:3.11-slim
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
WORKDIR /app
RUN pip install --no-cache-dir --index-url ${TORCH_INDEX} "torch>=2.4,<2.14"
COPY pyproject.toml README.md ./
COPY libs libs
COPY services services
RUN pip install --no-cache-dir ".[ml,plots]"
ENV PYTHONUNBUFFERED=1 BRIGADE_LOG_FORMAT=json BRIGADE_CACHE=/cache
VOLUME /cache
ENTRYPOINT ["brigade"]
