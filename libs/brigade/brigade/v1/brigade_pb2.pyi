from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LoraSpec(_message.Message):
    __slots__ = ("rank", "alpha", "dropout", "target_modules")
    RANK_FIELD_NUMBER: _ClassVar[int]
    ALPHA_FIELD_NUMBER: _ClassVar[int]
    DROPOUT_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODULES_FIELD_NUMBER: _ClassVar[int]
    rank: int
    alpha: float
    dropout: float
    target_modules: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, rank: _Optional[int] = ..., alpha: _Optional[float] = ..., dropout: _Optional[float] = ..., target_modules: _Optional[_Iterable[str]] = ...) -> None: ...

class SamplingSpec(_message.Message):
    __slots__ = ("group_size", "temperature", "top_p", "top_k", "max_new_tokens")
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    group_size: int
    temperature: float
    top_p: float
    top_k: int
    max_new_tokens: int
    def __init__(self, group_size: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., max_new_tokens: _Optional[int] = ...) -> None: ...

class GrpoSpec(_message.Message):
    __slots__ = ("learning_rate", "eps_low", "eps_high", "beta", "loss_agg", "scale_rewards", "max_grad_norm", "micro_batch_tokens", "tis_cap", "recompute_logprobs", "lr_schedule", "warmup_steps", "weight_decay")
    LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    EPS_LOW_FIELD_NUMBER: _ClassVar[int]
    EPS_HIGH_FIELD_NUMBER: _ClassVar[int]
    BETA_FIELD_NUMBER: _ClassVar[int]
    LOSS_AGG_FIELD_NUMBER: _ClassVar[int]
    SCALE_REWARDS_FIELD_NUMBER: _ClassVar[int]
    MAX_GRAD_NORM_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIS_CAP_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTE_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LR_SCHEDULE_FIELD_NUMBER: _ClassVar[int]
    WARMUP_STEPS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DECAY_FIELD_NUMBER: _ClassVar[int]
    learning_rate: float
    eps_low: float
    eps_high: float
    beta: float
    loss_agg: str
    scale_rewards: str
    max_grad_norm: float
    micro_batch_tokens: int
    tis_cap: float
    recompute_logprobs: bool
    lr_schedule: str
    warmup_steps: int
    weight_decay: float
    def __init__(self, learning_rate: _Optional[float] = ..., eps_low: _Optional[float] = ..., eps_high: _Optional[float] = ..., beta: _Optional[float] = ..., loss_agg: _Optional[str] = ..., scale_rewards: _Optional[str] = ..., max_grad_norm: _Optional[float] = ..., micro_batch_tokens: _Optional[int] = ..., tis_cap: _Optional[float] = ..., recompute_logprobs: _Optional[bool] = ..., lr_schedule: _Optional[str] = ..., warmup_steps: _Optional[int] = ..., weight_decay: _Optional[float] = ...) -> None: ...

class StalenessSpec(_message.Message):
    __slots__ = ("max_staleness", "lease_seconds", "max_attempts", "lookahead")
    MAX_STALENESS_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MAX_ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    LOOKAHEAD_FIELD_NUMBER: _ClassVar[int]
    max_staleness: int
    lease_seconds: int
    max_attempts: int
    lookahead: int
    def __init__(self, max_staleness: _Optional[int] = ..., lease_seconds: _Optional[int] = ..., max_attempts: _Optional[int] = ..., lookahead: _Optional[int] = ...) -> None: ...

class RewardSpec(_message.Message):
    __slots__ = ("function", "weight", "sandboxed", "timeout_s", "kwargs")
    FUNCTION_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    SANDBOXED_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    KWARGS_FIELD_NUMBER: _ClassVar[int]
    function: str
    weight: float
    sandboxed: bool
    timeout_s: float
    kwargs: str
    def __init__(self, function: _Optional[str] = ..., weight: _Optional[float] = ..., sandboxed: _Optional[bool] = ..., timeout_s: _Optional[float] = ..., kwargs: _Optional[str] = ...) -> None: ...

class EnvironmentSpec(_message.Message):
    __slots__ = ("tools", "factory", "factories", "max_turns", "tool_timeout_s", "tool_format", "max_turn_tokens")
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    FACTORY_FIELD_NUMBER: _ClassVar[int]
    FACTORIES_FIELD_NUMBER: _ClassVar[int]
    MAX_TURNS_FIELD_NUMBER: _ClassVar[int]
    TOOL_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    TOOL_FORMAT_FIELD_NUMBER: _ClassVar[int]
    MAX_TURN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    tools: _containers.RepeatedScalarFieldContainer[str]
    factory: str
    factories: str
    max_turns: int
    tool_timeout_s: float
    tool_format: str
    max_turn_tokens: int
    def __init__(self, tools: _Optional[_Iterable[str]] = ..., factory: _Optional[str] = ..., factories: _Optional[str] = ..., max_turns: _Optional[int] = ..., tool_timeout_s: _Optional[float] = ..., tool_format: _Optional[str] = ..., max_turn_tokens: _Optional[int] = ...) -> None: ...

class LocalSgdSpec(_message.Message):
    __slots__ = ("local_steps", "upload_seconds", "min_contributions", "round_timeout_s", "merge", "outer_optimizer", "outer_lr", "outer_momentum", "stale_weight")
    LOCAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    UPLOAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MIN_CONTRIBUTIONS_FIELD_NUMBER: _ClassVar[int]
    ROUND_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    MERGE_FIELD_NUMBER: _ClassVar[int]
    OUTER_OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    OUTER_LR_FIELD_NUMBER: _ClassVar[int]
    OUTER_MOMENTUM_FIELD_NUMBER: _ClassVar[int]
    STALE_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    local_steps: int
    upload_seconds: float
    min_contributions: int
    round_timeout_s: float
    merge: str
    outer_optimizer: str
    outer_lr: float
    outer_momentum: float
    stale_weight: float
    def __init__(self, local_steps: _Optional[int] = ..., upload_seconds: _Optional[float] = ..., min_contributions: _Optional[int] = ..., round_timeout_s: _Optional[float] = ..., merge: _Optional[str] = ..., outer_optimizer: _Optional[str] = ..., outer_lr: _Optional[float] = ..., outer_momentum: _Optional[float] = ..., stale_weight: _Optional[float] = ...) -> None: ...

class RunSpec(_message.Message):
    __slots__ = ("run_id", "model", "dtype", "device", "lora", "sampling", "grpo", "staleness", "rewards", "prompts_per_batch", "batches_per_step", "max_steps", "publish_every", "checkpoint_every", "seed", "adapter_payload", "eval_every", "sync", "epochs", "dataset", "eval_dataset", "revision", "trust_remote_code", "dataset_split", "eval_split", "prompt_column", "dataset_config", "report_to", "topology", "local_sgd", "push_to_hub", "hub_model_id", "environment")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    GRPO_FIELD_NUMBER: _ClassVar[int]
    STALENESS_FIELD_NUMBER: _ClassVar[int]
    REWARDS_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_PER_BATCH_FIELD_NUMBER: _ClassVar[int]
    BATCHES_PER_STEP_FIELD_NUMBER: _ClassVar[int]
    MAX_STEPS_FIELD_NUMBER: _ClassVar[int]
    PUBLISH_EVERY_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_EVERY_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    EVAL_EVERY_FIELD_NUMBER: _ClassVar[int]
    SYNC_FIELD_NUMBER: _ClassVar[int]
    EPOCHS_FIELD_NUMBER: _ClassVar[int]
    DATASET_FIELD_NUMBER: _ClassVar[int]
    EVAL_DATASET_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    TRUST_REMOTE_CODE_FIELD_NUMBER: _ClassVar[int]
    DATASET_SPLIT_FIELD_NUMBER: _ClassVar[int]
    EVAL_SPLIT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_COLUMN_FIELD_NUMBER: _ClassVar[int]
    DATASET_CONFIG_FIELD_NUMBER: _ClassVar[int]
    REPORT_TO_FIELD_NUMBER: _ClassVar[int]
    TOPOLOGY_FIELD_NUMBER: _ClassVar[int]
    LOCAL_SGD_FIELD_NUMBER: _ClassVar[int]
    PUSH_TO_HUB_FIELD_NUMBER: _ClassVar[int]
    HUB_MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    ENVIRONMENT_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    model: str
    dtype: str
    device: str
    lora: LoraSpec
    sampling: SamplingSpec
    grpo: GrpoSpec
    staleness: StalenessSpec
    rewards: _containers.RepeatedCompositeFieldContainer[RewardSpec]
    prompts_per_batch: int
    batches_per_step: int
    max_steps: int
    publish_every: int
    checkpoint_every: int
    seed: int
    adapter_payload: str
    eval_every: int
    sync: bool
    epochs: int
    dataset: str
    eval_dataset: str
    revision: str
    trust_remote_code: bool
    dataset_split: str
    eval_split: str
    prompt_column: str
    dataset_config: str
    report_to: _containers.RepeatedScalarFieldContainer[str]
    topology: str
    local_sgd: LocalSgdSpec
    push_to_hub: bool
    hub_model_id: str
    environment: EnvironmentSpec
    def __init__(self, run_id: _Optional[str] = ..., model: _Optional[str] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., lora: _Optional[_Union[LoraSpec, _Mapping]] = ..., sampling: _Optional[_Union[SamplingSpec, _Mapping]] = ..., grpo: _Optional[_Union[GrpoSpec, _Mapping]] = ..., staleness: _Optional[_Union[StalenessSpec, _Mapping]] = ..., rewards: _Optional[_Iterable[_Union[RewardSpec, _Mapping]]] = ..., prompts_per_batch: _Optional[int] = ..., batches_per_step: _Optional[int] = ..., max_steps: _Optional[int] = ..., publish_every: _Optional[int] = ..., checkpoint_every: _Optional[int] = ..., seed: _Optional[int] = ..., adapter_payload: _Optional[str] = ..., eval_every: _Optional[int] = ..., sync: _Optional[bool] = ..., epochs: _Optional[int] = ..., dataset: _Optional[str] = ..., eval_dataset: _Optional[str] = ..., revision: _Optional[str] = ..., trust_remote_code: _Optional[bool] = ..., dataset_split: _Optional[str] = ..., eval_split: _Optional[str] = ..., prompt_column: _Optional[str] = ..., dataset_config: _Optional[str] = ..., report_to: _Optional[_Iterable[str]] = ..., topology: _Optional[str] = ..., local_sgd: _Optional[_Union[LocalSgdSpec, _Mapping]] = ..., push_to_hub: _Optional[bool] = ..., hub_model_id: _Optional[str] = ..., environment: _Optional[_Union[EnvironmentSpec, _Mapping]] = ...) -> None: ...

class Prompt(_message.Message):
    __slots__ = ("id", "text", "columns", "messages_json", "columns_json")
    class ColumnsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    COLUMNS_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_JSON_FIELD_NUMBER: _ClassVar[int]
    COLUMNS_JSON_FIELD_NUMBER: _ClassVar[int]
    id: str
    text: str
    columns: _containers.ScalarMap[str, str]
    messages_json: str
    columns_json: str
    def __init__(self, id: _Optional[str] = ..., text: _Optional[str] = ..., columns: _Optional[_Mapping[str, str]] = ..., messages_json: _Optional[str] = ..., columns_json: _Optional[str] = ...) -> None: ...

class PromptBatch(_message.Message):
    __slots__ = ("batch_id", "run_id", "epoch", "index", "prompts")
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    batch_id: str
    run_id: str
    epoch: int
    index: int
    prompts: _containers.RepeatedCompositeFieldContainer[Prompt]
    def __init__(self, batch_id: _Optional[str] = ..., run_id: _Optional[str] = ..., epoch: _Optional[int] = ..., index: _Optional[int] = ..., prompts: _Optional[_Iterable[_Union[Prompt, _Mapping]]] = ...) -> None: ...

class Lease(_message.Message):
    __slots__ = ("lease_id", "run_id", "batch", "adapter_version", "seed", "attempt", "deadline_ms", "lease_seconds")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_VERSION_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_MS_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    run_id: str
    batch: PromptBatch
    adapter_version: int
    seed: int
    attempt: int
    deadline_ms: int
    lease_seconds: int
    def __init__(self, lease_id: _Optional[str] = ..., run_id: _Optional[str] = ..., batch: _Optional[_Union[PromptBatch, _Mapping]] = ..., adapter_version: _Optional[int] = ..., seed: _Optional[int] = ..., attempt: _Optional[int] = ..., deadline_ms: _Optional[int] = ..., lease_seconds: _Optional[int] = ...) -> None: ...

class RolloutManifest(_message.Message):
    __slots__ = ("run_id", "batch_id", "attempt", "worker_id", "policy_version", "uri", "sha256", "size_bytes", "num_samples", "num_tokens", "reward_mean", "compute_seconds", "price_per_hour", "capacity_class", "adapter_payload", "engine", "created_ms", "text_uri")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    URI_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REWARD_MEAN_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PRICE_PER_HOUR_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_CLASS_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    CREATED_MS_FIELD_NUMBER: _ClassVar[int]
    TEXT_URI_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    batch_id: str
    attempt: int
    worker_id: str
    policy_version: int
    uri: str
    sha256: str
    size_bytes: int
    num_samples: int
    num_tokens: int
    reward_mean: float
    compute_seconds: float
    price_per_hour: float
    capacity_class: str
    adapter_payload: str
    engine: str
    created_ms: int
    text_uri: str
    def __init__(self, run_id: _Optional[str] = ..., batch_id: _Optional[str] = ..., attempt: _Optional[int] = ..., worker_id: _Optional[str] = ..., policy_version: _Optional[int] = ..., uri: _Optional[str] = ..., sha256: _Optional[str] = ..., size_bytes: _Optional[int] = ..., num_samples: _Optional[int] = ..., num_tokens: _Optional[int] = ..., reward_mean: _Optional[float] = ..., compute_seconds: _Optional[float] = ..., price_per_hour: _Optional[float] = ..., capacity_class: _Optional[str] = ..., adapter_payload: _Optional[str] = ..., engine: _Optional[str] = ..., created_ms: _Optional[int] = ..., text_uri: _Optional[str] = ...) -> None: ...

class AdapterFile(_message.Message):
    __slots__ = ("name", "sha256", "size_bytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    sha256: str
    size_bytes: int
    def __init__(self, name: _Optional[str] = ..., sha256: _Optional[str] = ..., size_bytes: _Optional[int] = ...) -> None: ...

class AdapterManifest(_message.Message):
    __slots__ = ("run_id", "version", "step", "uri", "files", "payload", "created_ms", "quantization_error")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    URI_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    CREATED_MS_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_ERROR_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    version: int
    step: int
    uri: str
    files: _containers.RepeatedCompositeFieldContainer[AdapterFile]
    payload: str
    created_ms: int
    quantization_error: float
    def __init__(self, run_id: _Optional[str] = ..., version: _Optional[int] = ..., step: _Optional[int] = ..., uri: _Optional[str] = ..., files: _Optional[_Iterable[_Union[AdapterFile, _Mapping]]] = ..., payload: _Optional[str] = ..., created_ms: _Optional[int] = ..., quantization_error: _Optional[float] = ...) -> None: ...

class ContributionManifest(_message.Message):
    __slots__ = ("run_id", "contribution_id", "trainer_id", "base_version", "local_steps", "batch_ids", "empty_batch_ids", "uri", "sha256", "size_bytes", "num_samples", "reward_mean", "compute_seconds", "price_per_hour", "capacity_class", "created_ms")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    CONTRIBUTION_ID_FIELD_NUMBER: _ClassVar[int]
    TRAINER_ID_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    LOCAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    BATCH_IDS_FIELD_NUMBER: _ClassVar[int]
    EMPTY_BATCH_IDS_FIELD_NUMBER: _ClassVar[int]
    URI_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    REWARD_MEAN_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PRICE_PER_HOUR_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_CLASS_FIELD_NUMBER: _ClassVar[int]
    CREATED_MS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    contribution_id: str
    trainer_id: str
    base_version: int
    local_steps: int
    batch_ids: _containers.RepeatedScalarFieldContainer[str]
    empty_batch_ids: _containers.RepeatedScalarFieldContainer[str]
    uri: str
    sha256: str
    size_bytes: int
    num_samples: int
    reward_mean: float
    compute_seconds: float
    price_per_hour: float
    capacity_class: str
    created_ms: int
    def __init__(self, run_id: _Optional[str] = ..., contribution_id: _Optional[str] = ..., trainer_id: _Optional[str] = ..., base_version: _Optional[int] = ..., local_steps: _Optional[int] = ..., batch_ids: _Optional[_Iterable[str]] = ..., empty_batch_ids: _Optional[_Iterable[str]] = ..., uri: _Optional[str] = ..., sha256: _Optional[str] = ..., size_bytes: _Optional[int] = ..., num_samples: _Optional[int] = ..., reward_mean: _Optional[float] = ..., compute_seconds: _Optional[float] = ..., price_per_hour: _Optional[float] = ..., capacity_class: _Optional[str] = ..., created_ms: _Optional[int] = ...) -> None: ...

class Event(_message.Message):
    __slots__ = ("id", "run_id", "type", "time_ms", "attrs")
    class AttrsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    TIME_MS_FIELD_NUMBER: _ClassVar[int]
    ATTRS_FIELD_NUMBER: _ClassVar[int]
    id: str
    run_id: str
    type: str
    time_ms: int
    attrs: _containers.ScalarMap[str, str]
    def __init__(self, id: _Optional[str] = ..., run_id: _Optional[str] = ..., type: _Optional[str] = ..., time_ms: _Optional[int] = ..., attrs: _Optional[_Mapping[str, str]] = ...) -> None: ...

class AcquireLeaseRequest(_message.Message):
    __slots__ = ("run_id", "worker_id", "capacity_class", "price_per_hour", "engine")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_CLASS_FIELD_NUMBER: _ClassVar[int]
    PRICE_PER_HOUR_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    worker_id: str
    capacity_class: str
    price_per_hour: float
    engine: str
    def __init__(self, run_id: _Optional[str] = ..., worker_id: _Optional[str] = ..., capacity_class: _Optional[str] = ..., price_per_hour: _Optional[float] = ..., engine: _Optional[str] = ...) -> None: ...

class AcquireLeaseResponse(_message.Message):
    __slots__ = ("granted", "lease", "retry_after_ms", "reason")
    GRANTED_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_MS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    granted: bool
    lease: Lease
    retry_after_ms: int
    reason: str
    def __init__(self, granted: _Optional[bool] = ..., lease: _Optional[_Union[Lease, _Mapping]] = ..., retry_after_ms: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("run_id", "lease_id", "worker_id")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    lease_id: str
    worker_id: str
    def __init__(self, run_id: _Optional[str] = ..., lease_id: _Optional[str] = ..., worker_id: _Optional[str] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("status", "deadline_ms", "latest_adapter_version", "message")
    class Status(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        STATUS_UNSPECIFIED: _ClassVar[HeartbeatResponse.Status]
        OK: _ClassVar[HeartbeatResponse.Status]
        LOST: _ClassVar[HeartbeatResponse.Status]
        REVOKED: _ClassVar[HeartbeatResponse.Status]
    STATUS_UNSPECIFIED: HeartbeatResponse.Status
    OK: HeartbeatResponse.Status
    LOST: HeartbeatResponse.Status
    REVOKED: HeartbeatResponse.Status
    STATUS_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_MS_FIELD_NUMBER: _ClassVar[int]
    LATEST_ADAPTER_VERSION_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    status: HeartbeatResponse.Status
    deadline_ms: int
    latest_adapter_version: int
    message: str
    def __init__(self, status: _Optional[_Union[HeartbeatResponse.Status, str]] = ..., deadline_ms: _Optional[int] = ..., latest_adapter_version: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class CompleteLeaseRequest(_message.Message):
    __slots__ = ("run_id", "lease_id", "worker_id", "manifest", "next")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    NEXT_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    lease_id: str
    worker_id: str
    manifest: RolloutManifest
    next: AcquireLeaseRequest
    def __init__(self, run_id: _Optional[str] = ..., lease_id: _Optional[str] = ..., worker_id: _Optional[str] = ..., manifest: _Optional[_Union[RolloutManifest, _Mapping]] = ..., next: _Optional[_Union[AcquireLeaseRequest, _Mapping]] = ...) -> None: ...

class CompleteLeaseResponse(_message.Message):
    __slots__ = ("duplicate", "next")
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    NEXT_FIELD_NUMBER: _ClassVar[int]
    duplicate: bool
    next: AcquireLeaseResponse
    def __init__(self, duplicate: _Optional[bool] = ..., next: _Optional[_Union[AcquireLeaseResponse, _Mapping]] = ...) -> None: ...

class FailLeaseRequest(_message.Message):
    __slots__ = ("run_id", "lease_id", "worker_id", "reason", "message")
    class Reason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        REASON_UNSPECIFIED: _ClassVar[FailLeaseRequest.Reason]
        ERROR: _ClassVar[FailLeaseRequest.Reason]
        PREEMPTED: _ClassVar[FailLeaseRequest.Reason]
    REASON_UNSPECIFIED: FailLeaseRequest.Reason
    ERROR: FailLeaseRequest.Reason
    PREEMPTED: FailLeaseRequest.Reason
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    lease_id: str
    worker_id: str
    reason: FailLeaseRequest.Reason
    message: str
    def __init__(self, run_id: _Optional[str] = ..., lease_id: _Optional[str] = ..., worker_id: _Optional[str] = ..., reason: _Optional[_Union[FailLeaseRequest.Reason, str]] = ..., message: _Optional[str] = ...) -> None: ...

class FailLeaseResponse(_message.Message):
    __slots__ = ("requeued", "deadlettered", "next_attempt")
    REQUEUED_FIELD_NUMBER: _ClassVar[int]
    DEADLETTERED_FIELD_NUMBER: _ClassVar[int]
    NEXT_ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    requeued: bool
    deadlettered: bool
    next_attempt: int
    def __init__(self, requeued: _Optional[bool] = ..., deadlettered: _Optional[bool] = ..., next_attempt: _Optional[int] = ...) -> None: ...

class SubmitContributionRequest(_message.Message):
    __slots__ = ("run_id", "trainer_id", "lease_ids", "manifest")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    TRAINER_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    trainer_id: str
    lease_ids: _containers.RepeatedScalarFieldContainer[str]
    manifest: ContributionManifest
    def __init__(self, run_id: _Optional[str] = ..., trainer_id: _Optional[str] = ..., lease_ids: _Optional[_Iterable[str]] = ..., manifest: _Optional[_Union[ContributionManifest, _Mapping]] = ...) -> None: ...

class SubmitContributionResponse(_message.Message):
    __slots__ = ("duplicate",)
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    duplicate: bool
    def __init__(self, duplicate: _Optional[bool] = ...) -> None: ...

class PullRolloutsRequest(_message.Message):
    __slots__ = ("run_id", "max_manifests", "wait_ms", "include_pending", "learner_id")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_MANIFESTS_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_PENDING_FIELD_NUMBER: _ClassVar[int]
    LEARNER_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    max_manifests: int
    wait_ms: int
    include_pending: bool
    learner_id: str
    def __init__(self, run_id: _Optional[str] = ..., max_manifests: _Optional[int] = ..., wait_ms: _Optional[int] = ..., include_pending: _Optional[bool] = ..., learner_id: _Optional[str] = ...) -> None: ...

class PulledRollout(_message.Message):
    __slots__ = ("delivery_id", "manifest")
    DELIVERY_ID_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    delivery_id: str
    manifest: RolloutManifest
    def __init__(self, delivery_id: _Optional[str] = ..., manifest: _Optional[_Union[RolloutManifest, _Mapping]] = ...) -> None: ...

class PullRolloutsResponse(_message.Message):
    __slots__ = ("rollouts", "latest_adapter_version")
    ROLLOUTS_FIELD_NUMBER: _ClassVar[int]
    LATEST_ADAPTER_VERSION_FIELD_NUMBER: _ClassVar[int]
    rollouts: _containers.RepeatedCompositeFieldContainer[PulledRollout]
    latest_adapter_version: int
    def __init__(self, rollouts: _Optional[_Iterable[_Union[PulledRollout, _Mapping]]] = ..., latest_adapter_version: _Optional[int] = ...) -> None: ...

class AckRolloutsRequest(_message.Message):
    __slots__ = ("run_id", "delivery_ids", "consumed_batch_ids", "rejected_batch_ids", "step", "learner_id", "metrics_json")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    DELIVERY_IDS_FIELD_NUMBER: _ClassVar[int]
    CONSUMED_BATCH_IDS_FIELD_NUMBER: _ClassVar[int]
    REJECTED_BATCH_IDS_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    LEARNER_ID_FIELD_NUMBER: _ClassVar[int]
    METRICS_JSON_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    delivery_ids: _containers.RepeatedScalarFieldContainer[str]
    consumed_batch_ids: _containers.RepeatedScalarFieldContainer[str]
    rejected_batch_ids: _containers.RepeatedScalarFieldContainer[str]
    step: int
    learner_id: str
    metrics_json: str
    def __init__(self, run_id: _Optional[str] = ..., delivery_ids: _Optional[_Iterable[str]] = ..., consumed_batch_ids: _Optional[_Iterable[str]] = ..., rejected_batch_ids: _Optional[_Iterable[str]] = ..., step: _Optional[int] = ..., learner_id: _Optional[str] = ..., metrics_json: _Optional[str] = ...) -> None: ...

class AckRolloutsResponse(_message.Message):
    __slots__ = ("acked",)
    ACKED_FIELD_NUMBER: _ClassVar[int]
    acked: int
    def __init__(self, acked: _Optional[int] = ...) -> None: ...

class PullContributionsRequest(_message.Message):
    __slots__ = ("run_id", "max_contributions", "wait_ms", "include_pending", "aggregator_id")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTRIBUTIONS_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_PENDING_FIELD_NUMBER: _ClassVar[int]
    AGGREGATOR_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    max_contributions: int
    wait_ms: int
    include_pending: bool
    aggregator_id: str
    def __init__(self, run_id: _Optional[str] = ..., max_contributions: _Optional[int] = ..., wait_ms: _Optional[int] = ..., include_pending: _Optional[bool] = ..., aggregator_id: _Optional[str] = ...) -> None: ...

class PulledContribution(_message.Message):
    __slots__ = ("delivery_id", "manifest")
    DELIVERY_ID_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    delivery_id: str
    manifest: ContributionManifest
    def __init__(self, delivery_id: _Optional[str] = ..., manifest: _Optional[_Union[ContributionManifest, _Mapping]] = ...) -> None: ...

class PullContributionsResponse(_message.Message):
    __slots__ = ("contributions", "latest_adapter_version")
    CONTRIBUTIONS_FIELD_NUMBER: _ClassVar[int]
    LATEST_ADAPTER_VERSION_FIELD_NUMBER: _ClassVar[int]
    contributions: _containers.RepeatedCompositeFieldContainer[PulledContribution]
    latest_adapter_version: int
    def __init__(self, contributions: _Optional[_Iterable[_Union[PulledContribution, _Mapping]]] = ..., latest_adapter_version: _Optional[int] = ...) -> None: ...

class PublishAdapterRequest(_message.Message):
    __slots__ = ("run_id", "manifest", "step_busy_s")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    STEP_BUSY_S_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    manifest: AdapterManifest
    step_busy_s: float
    def __init__(self, run_id: _Optional[str] = ..., manifest: _Optional[_Union[AdapterManifest, _Mapping]] = ..., step_busy_s: _Optional[float] = ...) -> None: ...

class PublishAdapterResponse(_message.Message):
    __slots__ = ("latest_version",)
    LATEST_VERSION_FIELD_NUMBER: _ClassVar[int]
    latest_version: int
    def __init__(self, latest_version: _Optional[int] = ...) -> None: ...

class CreateRunRequest(_message.Message):
    __slots__ = ("spec", "prompts", "exist_ok")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    EXIST_OK_FIELD_NUMBER: _ClassVar[int]
    spec: RunSpec
    prompts: _containers.RepeatedCompositeFieldContainer[Prompt]
    exist_ok: bool
    def __init__(self, spec: _Optional[_Union[RunSpec, _Mapping]] = ..., prompts: _Optional[_Iterable[_Union[Prompt, _Mapping]]] = ..., exist_ok: _Optional[bool] = ...) -> None: ...

class CreateRunResponse(_message.Message):
    __slots__ = ("run_id", "created")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    created: bool
    def __init__(self, run_id: _Optional[str] = ..., created: _Optional[bool] = ...) -> None: ...

class RunRef(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class RunState(_message.Message):
    __slots__ = ("spec", "latest_version", "learner_step", "batches_created", "queued", "leased", "completed", "consumed", "rejected", "revoked", "expired", "deadlettered", "stale_removed", "duplicates", "created_ms", "num_prompts", "finished", "contributions", "lookahead", "generation_s", "step_busy_s")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    LATEST_VERSION_FIELD_NUMBER: _ClassVar[int]
    LEARNER_STEP_FIELD_NUMBER: _ClassVar[int]
    BATCHES_CREATED_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    LEASED_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_FIELD_NUMBER: _ClassVar[int]
    CONSUMED_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    REVOKED_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_FIELD_NUMBER: _ClassVar[int]
    DEADLETTERED_FIELD_NUMBER: _ClassVar[int]
    STALE_REMOVED_FIELD_NUMBER: _ClassVar[int]
    DUPLICATES_FIELD_NUMBER: _ClassVar[int]
    CREATED_MS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPTS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    CONTRIBUTIONS_FIELD_NUMBER: _ClassVar[int]
    LOOKAHEAD_FIELD_NUMBER: _ClassVar[int]
    GENERATION_S_FIELD_NUMBER: _ClassVar[int]
    STEP_BUSY_S_FIELD_NUMBER: _ClassVar[int]
    spec: RunSpec
    latest_version: int
    learner_step: int
    batches_created: int
    queued: int
    leased: int
    completed: int
    consumed: int
    rejected: int
    revoked: int
    expired: int
    deadlettered: int
    stale_removed: int
    duplicates: int
    created_ms: int
    num_prompts: int
    finished: bool
    contributions: int
    lookahead: int
    generation_s: float
    step_busy_s: float
    def __init__(self, spec: _Optional[_Union[RunSpec, _Mapping]] = ..., latest_version: _Optional[int] = ..., learner_step: _Optional[int] = ..., batches_created: _Optional[int] = ..., queued: _Optional[int] = ..., leased: _Optional[int] = ..., completed: _Optional[int] = ..., consumed: _Optional[int] = ..., rejected: _Optional[int] = ..., revoked: _Optional[int] = ..., expired: _Optional[int] = ..., deadlettered: _Optional[int] = ..., stale_removed: _Optional[int] = ..., duplicates: _Optional[int] = ..., created_ms: _Optional[int] = ..., num_prompts: _Optional[int] = ..., finished: _Optional[bool] = ..., contributions: _Optional[int] = ..., lookahead: _Optional[int] = ..., generation_s: _Optional[float] = ..., step_busy_s: _Optional[float] = ...) -> None: ...

class ListRunsRequest(_message.Message):
    __slots__ = ("page_size", "page_token")
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    page_size: int
    page_token: str
    def __init__(self, page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListRunsResponse(_message.Message):
    __slots__ = ("runs", "next_page_token")
    RUNS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    runs: _containers.RepeatedCompositeFieldContainer[RunState]
    next_page_token: str
    def __init__(self, runs: _Optional[_Iterable[_Union[RunState, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class WatchRunRequest(_message.Message):
    __slots__ = ("run_id", "after_id", "from_start")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    AFTER_ID_FIELD_NUMBER: _ClassVar[int]
    FROM_START_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    after_id: str
    from_start: bool
    def __init__(self, run_id: _Optional[str] = ..., after_id: _Optional[str] = ..., from_start: _Optional[bool] = ...) -> None: ...

class LeaseInfo(_message.Message):
    __slots__ = ("lease_id", "batch_id", "worker_id", "adapter_version", "attempt", "deadline_ms", "revoked")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_VERSION_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_MS_FIELD_NUMBER: _ClassVar[int]
    REVOKED_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    batch_id: str
    worker_id: str
    adapter_version: int
    attempt: int
    deadline_ms: int
    revoked: bool
    def __init__(self, lease_id: _Optional[str] = ..., batch_id: _Optional[str] = ..., worker_id: _Optional[str] = ..., adapter_version: _Optional[int] = ..., attempt: _Optional[int] = ..., deadline_ms: _Optional[int] = ..., revoked: _Optional[bool] = ...) -> None: ...

class ListLeasesResponse(_message.Message):
    __slots__ = ("leases",)
    LEASES_FIELD_NUMBER: _ClassVar[int]
    leases: _containers.RepeatedCompositeFieldContainer[LeaseInfo]
    def __init__(self, leases: _Optional[_Iterable[_Union[LeaseInfo, _Mapping]]] = ...) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("worker_id", "capacity_class", "price_per_hour", "last_seen_ms", "leases_granted", "leases_completed", "engine")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_CLASS_FIELD_NUMBER: _ClassVar[int]
    PRICE_PER_HOUR_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_MS_FIELD_NUMBER: _ClassVar[int]
    LEASES_GRANTED_FIELD_NUMBER: _ClassVar[int]
    LEASES_COMPLETED_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    capacity_class: str
    price_per_hour: float
    last_seen_ms: int
    leases_granted: int
    leases_completed: int
    engine: str
    def __init__(self, worker_id: _Optional[str] = ..., capacity_class: _Optional[str] = ..., price_per_hour: _Optional[float] = ..., last_seen_ms: _Optional[int] = ..., leases_granted: _Optional[int] = ..., leases_completed: _Optional[int] = ..., engine: _Optional[str] = ...) -> None: ...

class ListWorkersResponse(_message.Message):
    __slots__ = ("workers",)
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerInfo]
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerInfo, _Mapping]]] = ...) -> None: ...

class AdapterInfo(_message.Message):
    __slots__ = ("version", "step", "uri", "created_ms", "payload", "eval_json")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    URI_FIELD_NUMBER: _ClassVar[int]
    CREATED_MS_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    EVAL_JSON_FIELD_NUMBER: _ClassVar[int]
    version: int
    step: int
    uri: str
    created_ms: int
    payload: str
    eval_json: str
    def __init__(self, version: _Optional[int] = ..., step: _Optional[int] = ..., uri: _Optional[str] = ..., created_ms: _Optional[int] = ..., payload: _Optional[str] = ..., eval_json: _Optional[str] = ...) -> None: ...

class ListAdaptersResponse(_message.Message):
    __slots__ = ("adapters",)
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    adapters: _containers.RepeatedCompositeFieldContainer[AdapterInfo]
    def __init__(self, adapters: _Optional[_Iterable[_Union[AdapterInfo, _Mapping]]] = ...) -> None: ...

class GetMetricsRequest(_message.Message):
    __slots__ = ("run_id", "last")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    last: int
    def __init__(self, run_id: _Optional[str] = ..., last: _Optional[int] = ...) -> None: ...

class StepMetrics(_message.Message):
    __slots__ = ("step", "metrics_json")
    STEP_FIELD_NUMBER: _ClassVar[int]
    METRICS_JSON_FIELD_NUMBER: _ClassVar[int]
    step: int
    metrics_json: str
    def __init__(self, step: _Optional[int] = ..., metrics_json: _Optional[str] = ...) -> None: ...

class GetMetricsResponse(_message.Message):
    __slots__ = ("steps",)
    STEPS_FIELD_NUMBER: _ClassVar[int]
    steps: _containers.RepeatedCompositeFieldContainer[StepMetrics]
    def __init__(self, steps: _Optional[_Iterable[_Union[StepMetrics, _Mapping]]] = ...) -> None: ...

class DeadLetter(_message.Message):
    __slots__ = ("batch_id", "reason", "last_worker", "attempts", "time_ms")
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    LAST_WORKER_FIELD_NUMBER: _ClassVar[int]
    ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    TIME_MS_FIELD_NUMBER: _ClassVar[int]
    batch_id: str
    reason: str
    last_worker: str
    attempts: int
    time_ms: int
    def __init__(self, batch_id: _Optional[str] = ..., reason: _Optional[str] = ..., last_worker: _Optional[str] = ..., attempts: _Optional[int] = ..., time_ms: _Optional[int] = ...) -> None: ...

class ListDeadLettersResponse(_message.Message):
    __slots__ = ("dead_letters",)
    DEAD_LETTERS_FIELD_NUMBER: _ClassVar[int]
    dead_letters: _containers.RepeatedCompositeFieldContainer[DeadLetter]
    def __init__(self, dead_letters: _Optional[_Iterable[_Union[DeadLetter, _Mapping]]] = ...) -> None: ...
