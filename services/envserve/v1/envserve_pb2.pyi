from google.protobuf import struct_pb2 as _struct_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ItemStatus(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class Split(_message.Message):
    __slots__ = ("name", "description", "num_tasks")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    NUM_TASKS_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    num_tasks: int
    def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ..., num_tasks: _Optional[int] = ...) -> None: ...

class EnvSpec(_message.Message):
    __slots__ = ("env_id", "description", "system_prompt", "default_action_format", "action_formats", "max_turns", "max_actions_per_turn", "modalities", "config_schema_json", "splits", "action_space", "supports_snapshot", "replay_exact", "seed_varies_start")
    ENV_ID_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    SYSTEM_PROMPT_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_ACTION_FORMAT_FIELD_NUMBER: _ClassVar[int]
    ACTION_FORMATS_FIELD_NUMBER: _ClassVar[int]
    MAX_TURNS_FIELD_NUMBER: _ClassVar[int]
    MAX_ACTIONS_PER_TURN_FIELD_NUMBER: _ClassVar[int]
    MODALITIES_FIELD_NUMBER: _ClassVar[int]
    CONFIG_SCHEMA_JSON_FIELD_NUMBER: _ClassVar[int]
    SPLITS_FIELD_NUMBER: _ClassVar[int]
    ACTION_SPACE_FIELD_NUMBER: _ClassVar[int]
    SUPPORTS_SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    REPLAY_EXACT_FIELD_NUMBER: _ClassVar[int]
    SEED_VARIES_START_FIELD_NUMBER: _ClassVar[int]
    env_id: str
    description: str
    system_prompt: str
    default_action_format: str
    action_formats: _containers.RepeatedScalarFieldContainer[str]
    max_turns: int
    max_actions_per_turn: int
    modalities: _containers.RepeatedScalarFieldContainer[str]
    config_schema_json: str
    splits: _containers.RepeatedCompositeFieldContainer[Split]
    action_space: str
    supports_snapshot: bool
    replay_exact: bool
    seed_varies_start: bool
    def __init__(self, env_id: _Optional[str] = ..., description: _Optional[str] = ..., system_prompt: _Optional[str] = ..., default_action_format: _Optional[str] = ..., action_formats: _Optional[_Iterable[str]] = ..., max_turns: _Optional[int] = ..., max_actions_per_turn: _Optional[int] = ..., modalities: _Optional[_Iterable[str]] = ..., config_schema_json: _Optional[str] = ..., splits: _Optional[_Iterable[_Union[Split, _Mapping]]] = ..., action_space: _Optional[str] = ..., supports_snapshot: _Optional[bool] = ..., replay_exact: _Optional[bool] = ..., seed_varies_start: _Optional[bool] = ...) -> None: ...

class ListEnvsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListEnvsResponse(_message.Message):
    __slots__ = ("envs", "replica_id", "live_sessions", "capacity", "draining", "max_open_per_call", "max_batch_items")
    ENVS_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    LIVE_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    MAX_OPEN_PER_CALL_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_ITEMS_FIELD_NUMBER: _ClassVar[int]
    envs: _containers.RepeatedCompositeFieldContainer[EnvSpec]
    replica_id: str
    live_sessions: int
    capacity: int
    draining: bool
    max_open_per_call: int
    max_batch_items: int
    def __init__(self, envs: _Optional[_Iterable[_Union[EnvSpec, _Mapping]]] = ..., replica_id: _Optional[str] = ..., live_sessions: _Optional[int] = ..., capacity: _Optional[int] = ..., draining: _Optional[bool] = ..., max_open_per_call: _Optional[int] = ..., max_batch_items: _Optional[int] = ...) -> None: ...

class GetSpecRequest(_message.Message):
    __slots__ = ("env_id",)
    ENV_ID_FIELD_NUMBER: _ClassVar[int]
    env_id: str
    def __init__(self, env_id: _Optional[str] = ...) -> None: ...

class ListTasksRequest(_message.Message):
    __slots__ = ("env_id", "split", "page_size", "page_token")
    ENV_ID_FIELD_NUMBER: _ClassVar[int]
    SPLIT_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    env_id: str
    split: str
    page_size: int
    page_token: str
    def __init__(self, env_id: _Optional[str] = ..., split: _Optional[str] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class Task(_message.Message):
    __slots__ = ("task_id", "split", "description", "task_type", "parameters", "seed", "parameters_json")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    SPLIT_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    TASK_TYPE_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_JSON_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    split: str
    description: str
    task_type: str
    parameters: _struct_pb2.Struct
    seed: int
    parameters_json: str
    def __init__(self, task_id: _Optional[str] = ..., split: _Optional[str] = ..., description: _Optional[str] = ..., task_type: _Optional[str] = ..., parameters: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., seed: _Optional[int] = ..., parameters_json: _Optional[str] = ...) -> None: ...

class GetTaskStatsRequest(_message.Message):
    __slots__ = ("env_id", "scope")
    ENV_ID_FIELD_NUMBER: _ClassVar[int]
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    env_id: str
    scope: str
    def __init__(self, env_id: _Optional[str] = ..., scope: _Optional[str] = ...) -> None: ...

class TaskStat(_message.Message):
    __slots__ = ("task_id", "episodes", "successes", "return_sum", "turns_sum", "last_unix", "tokens_sum")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    EPISODES_FIELD_NUMBER: _ClassVar[int]
    SUCCESSES_FIELD_NUMBER: _ClassVar[int]
    RETURN_SUM_FIELD_NUMBER: _ClassVar[int]
    TURNS_SUM_FIELD_NUMBER: _ClassVar[int]
    LAST_UNIX_FIELD_NUMBER: _ClassVar[int]
    TOKENS_SUM_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    episodes: int
    successes: int
    return_sum: float
    turns_sum: int
    last_unix: float
    tokens_sum: int
    def __init__(self, task_id: _Optional[str] = ..., episodes: _Optional[int] = ..., successes: _Optional[int] = ..., return_sum: _Optional[float] = ..., turns_sum: _Optional[int] = ..., last_unix: _Optional[float] = ..., tokens_sum: _Optional[int] = ...) -> None: ...

class TaskStatsResponse(_message.Message):
    __slots__ = ("stats",)
    STATS_FIELD_NUMBER: _ClassVar[int]
    stats: _containers.RepeatedCompositeFieldContainer[TaskStat]
    def __init__(self, stats: _Optional[_Iterable[_Union[TaskStat, _Mapping]]] = ...) -> None: ...

class ListTasksResponse(_message.Message):
    __slots__ = ("tasks", "total", "next_page_token")
    TASKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    tasks: _containers.RepeatedCompositeFieldContainer[Task]
    total: int
    next_page_token: str
    def __init__(self, tasks: _Optional[_Iterable[_Union[Task, _Mapping]]] = ..., total: _Optional[int] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class OpenRequest(_message.Message):
    __slots__ = ("env_id", "count", "config", "action_format", "state_readers", "stats_scope", "config_json")
    ENV_ID_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    ACTION_FORMAT_FIELD_NUMBER: _ClassVar[int]
    STATE_READERS_FIELD_NUMBER: _ClassVar[int]
    STATS_SCOPE_FIELD_NUMBER: _ClassVar[int]
    CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    env_id: str
    count: int
    config: _struct_pb2.Struct
    action_format: str
    state_readers: _containers.RepeatedScalarFieldContainer[str]
    stats_scope: str
    config_json: str
    def __init__(self, env_id: _Optional[str] = ..., count: _Optional[int] = ..., config: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., action_format: _Optional[str] = ..., state_readers: _Optional[_Iterable[str]] = ..., stats_scope: _Optional[str] = ..., config_json: _Optional[str] = ...) -> None: ...

class OpenResponse(_message.Message):
    __slots__ = ("session_ids", "lease_seconds", "system_prompt", "live_sessions", "counted_unix", "max_open_per_call", "max_batch_items")
    SESSION_IDS_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SYSTEM_PROMPT_FIELD_NUMBER: _ClassVar[int]
    LIVE_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    COUNTED_UNIX_FIELD_NUMBER: _ClassVar[int]
    MAX_OPEN_PER_CALL_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_ITEMS_FIELD_NUMBER: _ClassVar[int]
    session_ids: _containers.RepeatedScalarFieldContainer[str]
    lease_seconds: float
    system_prompt: str
    live_sessions: int
    counted_unix: float
    max_open_per_call: int
    max_batch_items: int
    def __init__(self, session_ids: _Optional[_Iterable[str]] = ..., lease_seconds: _Optional[float] = ..., system_prompt: _Optional[str] = ..., live_sessions: _Optional[int] = ..., counted_unix: _Optional[float] = ..., max_open_per_call: _Optional[int] = ..., max_batch_items: _Optional[int] = ...) -> None: ...

class ResetItem(_message.Message):
    __slots__ = ("session_id", "seed", "task_id", "split", "same_task")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    SPLIT_FIELD_NUMBER: _ClassVar[int]
    SAME_TASK_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    seed: int
    task_id: str
    split: str
    same_task: bool
    def __init__(self, session_id: _Optional[str] = ..., seed: _Optional[int] = ..., task_id: _Optional[str] = ..., split: _Optional[str] = ..., same_task: _Optional[bool] = ...) -> None: ...

class ResetRequest(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[ResetItem]
    def __init__(self, items: _Optional[_Iterable[_Union[ResetItem, _Mapping]]] = ...) -> None: ...

class StepItem(_message.Message):
    __slots__ = ("session_id", "action", "generated_tokens")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    action: str
    generated_tokens: int
    def __init__(self, session_id: _Optional[str] = ..., action: _Optional[str] = ..., generated_tokens: _Optional[int] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[StepItem]
    def __init__(self, items: _Optional[_Iterable[_Union[StepItem, _Mapping]]] = ...) -> None: ...

class Image(_message.Message):
    __slots__ = ("png", "height", "width", "channels", "name")
    PNG_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    CHANNELS_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    png: bytes
    height: int
    width: int
    channels: int
    name: str
    def __init__(self, png: _Optional[bytes] = ..., height: _Optional[int] = ..., width: _Optional[int] = ..., channels: _Optional[int] = ..., name: _Optional[str] = ...) -> None: ...

class Observation(_message.Message):
    __slots__ = ("text", "images", "turn", "episode")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    TURN_FIELD_NUMBER: _ClassVar[int]
    EPISODE_FIELD_NUMBER: _ClassVar[int]
    text: str
    images: _containers.RepeatedCompositeFieldContainer[Image]
    turn: int
    episode: int
    def __init__(self, text: _Optional[str] = ..., images: _Optional[_Iterable[_Union[Image, _Mapping]]] = ..., turn: _Optional[int] = ..., episode: _Optional[int] = ...) -> None: ...

class StepResult(_message.Message):
    __slots__ = ("session_id", "status", "observation", "reward", "reward_components", "done", "truncated", "success", "action_valid", "actions_executed", "parsed_actions", "reasoning", "anchor", "feedback", "info", "turn", "episode", "transition", "trial", "info_json")
    class RewardComponentsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class ReasoningEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    OBSERVATION_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    REWARD_COMPONENTS_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    SUCCESS_FIELD_NUMBER: _ClassVar[int]
    ACTION_VALID_FIELD_NUMBER: _ClassVar[int]
    ACTIONS_EXECUTED_FIELD_NUMBER: _ClassVar[int]
    PARSED_ACTIONS_FIELD_NUMBER: _ClassVar[int]
    REASONING_FIELD_NUMBER: _ClassVar[int]
    ANCHOR_FIELD_NUMBER: _ClassVar[int]
    FEEDBACK_FIELD_NUMBER: _ClassVar[int]
    INFO_FIELD_NUMBER: _ClassVar[int]
    TURN_FIELD_NUMBER: _ClassVar[int]
    EPISODE_FIELD_NUMBER: _ClassVar[int]
    TRANSITION_FIELD_NUMBER: _ClassVar[int]
    TRIAL_FIELD_NUMBER: _ClassVar[int]
    INFO_JSON_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    status: ItemStatus
    observation: Observation
    reward: float
    reward_components: _containers.ScalarMap[str, float]
    done: bool
    truncated: bool
    success: bool
    action_valid: bool
    actions_executed: int
    parsed_actions: _containers.RepeatedScalarFieldContainer[str]
    reasoning: _containers.ScalarMap[str, str]
    anchor: str
    feedback: str
    info: _struct_pb2.Struct
    turn: int
    episode: int
    transition: str
    trial: int
    info_json: str
    def __init__(self, session_id: _Optional[str] = ..., status: _Optional[_Union[ItemStatus, _Mapping]] = ..., observation: _Optional[_Union[Observation, _Mapping]] = ..., reward: _Optional[float] = ..., reward_components: _Optional[_Mapping[str, float]] = ..., done: _Optional[bool] = ..., truncated: _Optional[bool] = ..., success: _Optional[bool] = ..., action_valid: _Optional[bool] = ..., actions_executed: _Optional[int] = ..., parsed_actions: _Optional[_Iterable[str]] = ..., reasoning: _Optional[_Mapping[str, str]] = ..., anchor: _Optional[str] = ..., feedback: _Optional[str] = ..., info: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., turn: _Optional[int] = ..., episode: _Optional[int] = ..., transition: _Optional[str] = ..., trial: _Optional[int] = ..., info_json: _Optional[str] = ...) -> None: ...

class BatchResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[StepResult]
    def __init__(self, results: _Optional[_Iterable[_Union[StepResult, _Mapping]]] = ...) -> None: ...

class InteractRequest(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[InteractItem]
    def __init__(self, items: _Optional[_Iterable[_Union[InteractItem, _Mapping]]] = ...) -> None: ...

class InteractItem(_message.Message):
    __slots__ = ("tag", "reset", "step")
    TAG_FIELD_NUMBER: _ClassVar[int]
    RESET_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    tag: int
    reset: ResetItem
    step: StepItem
    def __init__(self, tag: _Optional[int] = ..., reset: _Optional[_Union[ResetItem, _Mapping]] = ..., step: _Optional[_Union[StepItem, _Mapping]] = ...) -> None: ...

class InteractResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[InteractResult]
    def __init__(self, results: _Optional[_Iterable[_Union[InteractResult, _Mapping]]] = ...) -> None: ...

class InteractResult(_message.Message):
    __slots__ = ("tag", "result")
    TAG_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    tag: int
    result: StepResult
    def __init__(self, tag: _Optional[int] = ..., result: _Optional[_Union[StepResult, _Mapping]] = ...) -> None: ...

class ForkRequest(_message.Message):
    __slots__ = ("session_id", "count")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    count: int
    def __init__(self, session_id: _Optional[str] = ..., count: _Optional[int] = ...) -> None: ...

class ForkResponse(_message.Message):
    __slots__ = ("session_ids",)
    SESSION_IDS_FIELD_NUMBER: _ClassVar[int]
    session_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, session_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class ReplayTurn(_message.Message):
    __slots__ = ("action", "anchor")
    ACTION_FIELD_NUMBER: _ClassVar[int]
    ANCHOR_FIELD_NUMBER: _ClassVar[int]
    action: str
    anchor: str
    def __init__(self, action: _Optional[str] = ..., anchor: _Optional[str] = ...) -> None: ...

class SessionHistory(_message.Message):
    __slots__ = ("env_id", "config", "action_format", "seed", "trial", "episode", "reset_anchor", "turns", "state_readers", "stats_scope", "config_json")
    ENV_ID_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    ACTION_FORMAT_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    TRIAL_FIELD_NUMBER: _ClassVar[int]
    EPISODE_FIELD_NUMBER: _ClassVar[int]
    RESET_ANCHOR_FIELD_NUMBER: _ClassVar[int]
    TURNS_FIELD_NUMBER: _ClassVar[int]
    STATE_READERS_FIELD_NUMBER: _ClassVar[int]
    STATS_SCOPE_FIELD_NUMBER: _ClassVar[int]
    CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    env_id: str
    config: _struct_pb2.Struct
    action_format: str
    seed: int
    trial: int
    episode: int
    reset_anchor: str
    turns: _containers.RepeatedCompositeFieldContainer[ReplayTurn]
    state_readers: _containers.RepeatedScalarFieldContainer[str]
    stats_scope: str
    config_json: str
    def __init__(self, env_id: _Optional[str] = ..., config: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., action_format: _Optional[str] = ..., seed: _Optional[int] = ..., trial: _Optional[int] = ..., episode: _Optional[int] = ..., reset_anchor: _Optional[str] = ..., turns: _Optional[_Iterable[_Union[ReplayTurn, _Mapping]]] = ..., state_readers: _Optional[_Iterable[str]] = ..., stats_scope: _Optional[str] = ..., config_json: _Optional[str] = ...) -> None: ...

class RestoreRequest(_message.Message):
    __slots__ = ("sessions",)
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    sessions: _containers.RepeatedCompositeFieldContainer[SessionHistory]
    def __init__(self, sessions: _Optional[_Iterable[_Union[SessionHistory, _Mapping]]] = ...) -> None: ...

class RestoredSession(_message.Message):
    __slots__ = ("session_id", "status", "anchor")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ANCHOR_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    status: ItemStatus
    anchor: str
    def __init__(self, session_id: _Optional[str] = ..., status: _Optional[_Union[ItemStatus, _Mapping]] = ..., anchor: _Optional[str] = ...) -> None: ...

class RestoreResponse(_message.Message):
    __slots__ = ("sessions", "lease_seconds")
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    sessions: _containers.RepeatedCompositeFieldContainer[RestoredSession]
    lease_seconds: float
    def __init__(self, sessions: _Optional[_Iterable[_Union[RestoredSession, _Mapping]]] = ..., lease_seconds: _Optional[float] = ...) -> None: ...

class CloseRequest(_message.Message):
    __slots__ = ("session_ids",)
    SESSION_IDS_FIELD_NUMBER: _ClassVar[int]
    session_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, session_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class CloseResponse(_message.Message):
    __slots__ = ("statuses",)
    STATUSES_FIELD_NUMBER: _ClassVar[int]
    statuses: _containers.RepeatedCompositeFieldContainer[ItemStatus]
    def __init__(self, statuses: _Optional[_Iterable[_Union[ItemStatus, _Mapping]]] = ...) -> None: ...

class GetStateRequest(_message.Message):
    __slots__ = ("session_id", "turn", "episode", "trial")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TURN_FIELD_NUMBER: _ClassVar[int]
    EPISODE_FIELD_NUMBER: _ClassVar[int]
    TRIAL_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    turn: int
    episode: int
    trial: int
    def __init__(self, session_id: _Optional[str] = ..., turn: _Optional[int] = ..., episode: _Optional[int] = ..., trial: _Optional[int] = ...) -> None: ...

class ReadStateRequest(_message.Message):
    __slots__ = ("session_id", "turn", "episode", "trial")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TURN_FIELD_NUMBER: _ClassVar[int]
    EPISODE_FIELD_NUMBER: _ClassVar[int]
    TRIAL_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    turn: int
    episode: int
    trial: int
    def __init__(self, session_id: _Optional[str] = ..., turn: _Optional[int] = ..., episode: _Optional[int] = ..., trial: _Optional[int] = ...) -> None: ...

class GetStateResponse(_message.Message):
    __slots__ = ("session_id", "turn", "episode", "state", "relations", "anchor", "observation_text", "env_id", "trial", "state_json")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TURN_FIELD_NUMBER: _ClassVar[int]
    EPISODE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    RELATIONS_FIELD_NUMBER: _ClassVar[int]
    ANCHOR_FIELD_NUMBER: _ClassVar[int]
    OBSERVATION_TEXT_FIELD_NUMBER: _ClassVar[int]
    ENV_ID_FIELD_NUMBER: _ClassVar[int]
    TRIAL_FIELD_NUMBER: _ClassVar[int]
    STATE_JSON_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    turn: int
    episode: int
    state: _struct_pb2.Struct
    relations: _containers.RepeatedScalarFieldContainer[str]
    anchor: str
    observation_text: str
    env_id: str
    trial: int
    state_json: str
    def __init__(self, session_id: _Optional[str] = ..., turn: _Optional[int] = ..., episode: _Optional[int] = ..., state: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., relations: _Optional[_Iterable[str]] = ..., anchor: _Optional[str] = ..., observation_text: _Optional[str] = ..., env_id: _Optional[str] = ..., trial: _Optional[int] = ..., state_json: _Optional[str] = ...) -> None: ...

class ListSessionsRequest(_message.Message):
    __slots__ = ("env_id", "limit", "include_images")
    ENV_ID_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_IMAGES_FIELD_NUMBER: _ClassVar[int]
    env_id: str
    limit: int
    include_images: bool
    def __init__(self, env_id: _Optional[str] = ..., limit: _Optional[int] = ..., include_images: _Optional[bool] = ...) -> None: ...

class SessionSummary(_message.Message):
    __slots__ = ("session_id", "env_id", "episode", "turn", "reward", "episode_return", "done", "success", "observation_text", "image", "last_action", "updated_unix", "truncated", "started", "action_format")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ENV_ID_FIELD_NUMBER: _ClassVar[int]
    EPISODE_FIELD_NUMBER: _ClassVar[int]
    TURN_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    EPISODE_RETURN_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    SUCCESS_FIELD_NUMBER: _ClassVar[int]
    OBSERVATION_TEXT_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    LAST_ACTION_FIELD_NUMBER: _ClassVar[int]
    UPDATED_UNIX_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    STARTED_FIELD_NUMBER: _ClassVar[int]
    ACTION_FORMAT_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    env_id: str
    episode: int
    turn: int
    reward: float
    episode_return: float
    done: bool
    success: bool
    observation_text: str
    image: Image
    last_action: str
    updated_unix: float
    truncated: bool
    started: bool
    action_format: str
    def __init__(self, session_id: _Optional[str] = ..., env_id: _Optional[str] = ..., episode: _Optional[int] = ..., turn: _Optional[int] = ..., reward: _Optional[float] = ..., episode_return: _Optional[float] = ..., done: _Optional[bool] = ..., success: _Optional[bool] = ..., observation_text: _Optional[str] = ..., image: _Optional[_Union[Image, _Mapping]] = ..., last_action: _Optional[str] = ..., updated_unix: _Optional[float] = ..., truncated: _Optional[bool] = ..., started: _Optional[bool] = ..., action_format: _Optional[str] = ...) -> None: ...

class ListSessionsResponse(_message.Message):
    __slots__ = ("replica_id", "sessions", "total")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    sessions: _containers.RepeatedCompositeFieldContainer[SessionSummary]
    total: int
    def __init__(self, replica_id: _Optional[str] = ..., sessions: _Optional[_Iterable[_Union[SessionSummary, _Mapping]]] = ..., total: _Optional[int] = ...) -> None: ...

class JudgeItem(_message.Message):
    __slots__ = ("key", "session_id", "turn", "episode", "field", "text", "env_id", "trial", "scope")
    KEY_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TURN_FIELD_NUMBER: _ClassVar[int]
    EPISODE_FIELD_NUMBER: _ClassVar[int]
    FIELD_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    ENV_ID_FIELD_NUMBER: _ClassVar[int]
    TRIAL_FIELD_NUMBER: _ClassVar[int]
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    key: str
    session_id: str
    turn: int
    episode: int
    field: str
    text: str
    env_id: str
    trial: int
    scope: str
    def __init__(self, key: _Optional[str] = ..., session_id: _Optional[str] = ..., turn: _Optional[int] = ..., episode: _Optional[int] = ..., field: _Optional[str] = ..., text: _Optional[str] = ..., env_id: _Optional[str] = ..., trial: _Optional[int] = ..., scope: _Optional[str] = ...) -> None: ...

class JudgeRequest(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[JudgeItem]
    def __init__(self, items: _Optional[_Iterable[_Union[JudgeItem, _Mapping]]] = ...) -> None: ...

class JudgeResult(_message.Message):
    __slots__ = ("key", "status", "score", "verdict", "reasoning", "raw_score", "repetition_penalized", "judge", "cached", "precision", "recall", "f1", "truth_turn", "truth_anchor", "env_id", "field")
    KEY_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    VERDICT_FIELD_NUMBER: _ClassVar[int]
    REASONING_FIELD_NUMBER: _ClassVar[int]
    RAW_SCORE_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALIZED_FIELD_NUMBER: _ClassVar[int]
    JUDGE_FIELD_NUMBER: _ClassVar[int]
    CACHED_FIELD_NUMBER: _ClassVar[int]
    PRECISION_FIELD_NUMBER: _ClassVar[int]
    RECALL_FIELD_NUMBER: _ClassVar[int]
    F1_FIELD_NUMBER: _ClassVar[int]
    TRUTH_TURN_FIELD_NUMBER: _ClassVar[int]
    TRUTH_ANCHOR_FIELD_NUMBER: _ClassVar[int]
    ENV_ID_FIELD_NUMBER: _ClassVar[int]
    FIELD_FIELD_NUMBER: _ClassVar[int]
    key: str
    status: ItemStatus
    score: float
    verdict: bool
    reasoning: str
    raw_score: float
    repetition_penalized: bool
    judge: str
    cached: bool
    precision: float
    recall: float
    f1: float
    truth_turn: int
    truth_anchor: str
    env_id: str
    field: str
    def __init__(self, key: _Optional[str] = ..., status: _Optional[_Union[ItemStatus, _Mapping]] = ..., score: _Optional[float] = ..., verdict: _Optional[bool] = ..., reasoning: _Optional[str] = ..., raw_score: _Optional[float] = ..., repetition_penalized: _Optional[bool] = ..., judge: _Optional[str] = ..., cached: _Optional[bool] = ..., precision: _Optional[float] = ..., recall: _Optional[float] = ..., f1: _Optional[float] = ..., truth_turn: _Optional[int] = ..., truth_anchor: _Optional[str] = ..., env_id: _Optional[str] = ..., field: _Optional[str] = ...) -> None: ...

class GetJudgeInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class JudgeInfo(_message.Message):
    __slots__ = ("judge_by_env", "fallback_judge", "config", "judges", "config_json")
    class JudgeByEnvEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    JUDGE_BY_ENV_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_JUDGE_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    JUDGES_FIELD_NUMBER: _ClassVar[int]
    CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    judge_by_env: _containers.ScalarMap[str, str]
    fallback_judge: str
    config: _struct_pb2.Struct
    judges: _containers.RepeatedScalarFieldContainer[str]
    config_json: str
    def __init__(self, judge_by_env: _Optional[_Mapping[str, str]] = ..., fallback_judge: _Optional[str] = ..., config: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., judges: _Optional[_Iterable[str]] = ..., config_json: _Optional[str] = ...) -> None: ...
