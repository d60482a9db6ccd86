"""examples/verl/: the parquet writer against a real replica, the run script's hydra overrides (its
DRY_RUN output), both YAML files and the fleet route (FLEET=1, main_ppo_fleet.py).

In `make test` (no verl in the venv): the dataset's rows, columns and seeds, the overrides as a dotlist,
the files they name, and the YAML entries against envserve's own classes. With verl (`make test-verl`,
ENVSERVE_TEST_VERL=1 in .verl-venv): verl's own ppo_trainer config composed with the run script's
overrides and validated as main_ppo does, verl's RLHFDataset reading the parquet, and verl's tool loader
building EnvServeTool from tools.yaml, whose first observation is the row's, and main_ppo_fleet.py
starting a real fleet on its own Ray and handing verl's main_ppo the overrides. Training itself needs a
vLLM or SGLang rollout on a GPU and is not run."""
from __future__ import annotations

import ast
import os
import re
import sys
from pathlib import Path

import pytest

from exampleproc import EXAMPLES, ROOT, live_session_ids, run_example
from serverproc import ServerProcess

pd = pytest.importorskip("pandas")
OmegaConf = pytest.importorskip("omegaconf").OmegaConf

VERL = EXAMPLES / "verl"
TRAIN, VAL, VAL_SEED = 6, 2, 1000


@pytest.fixture(scope="module")
def sokoban():
    with ServerProcess(["sokoban"], workers=1, metrics=False) as server:
        yield server


@pytest.fixture(scope="module")
def dataset(sokoban, tmp_path_factory) -> Path:
    data = tmp_path_factory.mktemp("verl-data")
    out = run_example(["verl/write_dataset.py", "--address", sokoban.address, "--env-id", "sokoban",
                       "--train", TRAIN, "--val", VAL, "--val-seed", VAL_SEED, "--out-dir", data]).stdout
    assert f"train.parquet: {TRAIN} rows" in out and f"val.parquet: {VAL} rows" in out
    return data


def dry_run(sokoban, data: Path, *extra: str, env: dict | None = None) -> list[str]:
    """The run script's command, one word a line (DRY_RUN=1); it exports the dataset where `data`
    has none."""
    out = run_example([str(VERL / "run_sokoban.sh"), *extra],
                      env={"DRY_RUN": "1", "PYTHON": sys.executable, "DATA": str(data),
                           "ENVSERVE_ADDRESS": sokoban.address, "MODEL": "/models/tiny", **(env or {})}).stdout
    lines = out.splitlines()
    assert lines[0] == f"{sys.executable} -m verl.trainer.main_ppo"
    return lines[1:]


def test_the_writer_writes_one_row_per_level_with_verls_columns(sokoban, dataset):
    from envserve.client import EnvClient
    train, val = pd.read_parquet(dataset / "train.parquet"), pd.read_parquet(dataset / "val.parquet")
    assert (len(train), len(val)) == (TRAIN, VAL)
    assert list(train.columns) == ["data_source", "prompt", "ability", "reward_model", "agent_name", "extra_info"]
    assert set(train.data_source) == {"envserve/sokoban"} and set(train.agent_name) == {"envserve_agent"}
    seeds = [e["seed"] for e in train.extra_info]
    assert seeds == list(range(TRAIN)) and [e["seed"] for e in val.extra_info] == [VAL_SEED, VAL_SEED + 1]
    assert [e["index"] for e in train.extra_info] == list(range(TRAIN))
    with EnvClient(sokoban.address) as c:
        sid = c.open("sokoban", 1, None, "")[0]
        for row, extra in zip(train.prompt, train.extra_info):
            (message,) = row
            # The prompt ends with the level's own first observation; the tool gets the same seed.
            assert message["role"] == "user"
            assert message["content"].endswith(c.reset_one(sid, extra["seed"]).observation.text)
            assert extra["tools_kwargs"] == {"move": {"create_kwargs": {"seed": extra["seed"]}}}
            assert extra["env_id"] == "sokoban" and extra["split"] == "train"
        c.close_sessions([sid])
    assert len({m[0]["content"] for m in train.prompt}) > 1        # different seeds, different levels
    assert not live_session_ids(sokoban.address, "sokoban")
    bad = run_example(["verl/write_dataset.py", "--address", sokoban.address, "--train", "0", "--out-dir",
                       dataset / "bad"], check=False)
    assert bad.returncode == 2 and "--train must be >= 1" in bad.stderr


@pytest.fixture(scope="module")
def exported(sokoban, tmp_path_factory) -> Path:
    """The recipe's own dataset: run with an empty DATA, it exports Sokoban's splits with the CLI."""
    data = tmp_path_factory.mktemp("verl-exported") / "data"
    dry_run(sokoban, data, env={"TRAIN_TASKS": "5", "VAL_TASKS": "2"})
    return data


def test_the_recipe_exports_the_listed_tasks_as_verls_rows(sokoban, exported):
    from envserve.client import EnvClient
    train, val = pd.read_parquet(exported / "train.parquet"), pd.read_parquet(exported / "val.parquet")
    assert list(train.columns) == ["data_source", "prompt", "ability", "reward_model", "agent_name", "extra_info"]
    with EnvClient(sokoban.address) as c:
        listed = {s: c.list_tasks("sokoban", s, n).tasks for s, n in (("train", 5), ("test", 2))}
    for frame, split in ((train, "train"), (val, "test")):
        assert [e["task_id"] for e in frame.extra_info] == [t.task_id for t in listed[split]]
        assert [e["seed"] for e in frame.extra_info] == [t.seed for t in listed[split]]
        assert {e["env_id"] for e in frame.extra_info} == {"sokoban"} and set(frame.agent_name) == {"envserve_agent"}
    assert [e["tools_kwargs"]["move"]["create_kwargs"]["seed"] for e in train.extra_info] == [t.seed for t in listed["train"]]
    assert not live_session_ids(sokoban.address, "sokoban")


def classes_in(module: Path) -> set[str]:
    return {n.name for n in ast.parse(module.read_text()).body if isinstance(n, ast.ClassDef)}


def test_the_run_scripts_overrides_and_yaml_files_name_what_exists(sokoban, dataset):
    overrides = dry_run(sokoban, dataset, "trainer.total_training_steps=2")
    cfg = OmegaConf.from_dotlist(overrides)                  # every word is key=value
    assert cfg.trainer.total_training_steps == 2              # extra arguments come last, as overrides
    assert cfg.algorithm.adv_estimator == "grpo" and cfg.actor_rollout_ref.model.path == "/models/tiny"
    assert Path(cfg.data.train_files) == dataset / "train.parquet" and Path(cfg.data.val_files).exists()
    rollout = cfg.actor_rollout_ref.rollout
    assert rollout.response_length == cfg.data.max_response_length
    loops = OmegaConf.load(rollout.agent.agent_loop_config_path)
    assert Path(rollout.agent.agent_loop_config_path) == VERL / "agent_loops.yaml"
    (entry,) = loops
    assert entry.name == rollout.agent.default_agent_loop == "envserve_agent"
    verl_module = ROOT / "services" / "envserve" / "integrations" / "verl.py"
    module, cls = entry._target_.rsplit(".", 1)
    assert module == "envserve.integrations.verl" and cls in classes_in(verl_module)
    tools = OmegaConf.load(VERL / "tools.yaml").tools
    assert [t.class_name.rsplit(".", 1)[1] for t in tools] == ["EnvServeTool"]
    assert "EnvServeTool" in classes_in(verl_module)
    # What the files ask of the env exists on the replica: the env, its format, its config keys.
    from envserve.client import EnvClient
    with EnvClient(sokoban.address) as c:
        spec = c.get_spec(entry.env_id)
        assert entry.action_format in spec.action_formats
        sid = c.open(entry.env_id, 1, OmegaConf.to_container(entry.env_config), entry.action_format)[0]
        c.close_sessions([sid])
        assert c.get_spec(tools[0].config.env_id).env_id == "sokoban"


verl_only = pytest.mark.skipif(os.environ.get("ENVSERVE_TEST_VERL") != "1",
                               reason="verl is opt-in: `make test-verl` (its own venv, deploy/trainer/verl-venv.sh)")


@verl_only
def test_verl_composes_validates_and_reads_the_recipe(sokoban, dataset, tmp_path):
    pytest.importorskip("verl")
    import verl
    from hydra import compose, initialize_config_dir
    from transformers import AutoTokenizer
    from verl.tools.tool_registry import initialize_tools_from_config
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config
    from verl.utils.dataset.rl_dataset import RLHFDataset

    from envserve_trainer.models.small import build_tokenizer
    tok = build_tokenizer(["Solve the level. # _ P X O"])
    tok.save_pretrained(tmp_path)
    overrides = [o.replace("/models/tiny", str(tmp_path)) for o in dry_run(sokoban, dataset)]
    with initialize_config_dir(config_dir=os.path.join(os.path.dirname(verl.__file__), "trainer", "config"),
                               version_base=None):
        cfg = compose("ppo_trainer", overrides=overrides)
    validate_config(cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
    rows = RLHFDataset(data_files=cfg.data.train_files, tokenizer=AutoTokenizer.from_pretrained(tmp_path),
                       config=cfg.data)
    assert len(rows) == TRAIN
    row = rows[3]
    assert row["index"] == 3 and row["tools_kwargs"] == {"move": {"create_kwargs": {"seed": 3}}}
    # verl's tool loader builds EnvServeTool from tools.yaml (its address from ENVSERVE_ADDRESS).
    import asyncio
    os.environ["ENVSERVE_ADDRESS"] = sokoban.address
    try:
        (tool,) = initialize_tools_from_config(str(VERL / "tools.yaml"))
    finally:
        del os.environ["ENVSERVE_ADDRESS"]
    assert tool.name == "move" and tool.per_trajectory

    async def first():
        iid, response = await tool.create(create_kwargs=row["tools_kwargs"]["move"]["create_kwargs"])
        await tool.release(iid)
        return response.text
    grid = row["raw_prompt"][0]["content"].split("\n\n", 1)[1]
    assert grid in asyncio.run(first())


@verl_only
def test_verls_dataset_and_sampler_read_the_exported_rows(sokoban, exported, tmp_path, monkeypatch):
    """verl's RLHFDataset reads the exported parquet, and a DataLoader made as verl's trainer makes
    its own (verl's collate_fn, the sampler given to RayPPOTrainer) draws batches of different tasks
    through EnvServeTaskSampler, weighted by the outcome statistics of the run's scope (a task
    always solved drawn least)."""
    pytest.importorskip("verl")
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer
    from torch.utils.data import DataLoader
    from verl.utils.dataset.rl_dataset import RLHFDataset, collate_fn

    from envserve.client import EnvClient
    from envserve.client.experts import play_expert
    from envserve_trainer.models.small import build_tokenizer
    from outcomes import stats_when
    from envserve.integrations.verl import EnvServeTaskSampler

    scope = f"verl-sampler-{os.getpid()}"
    with EnvClient(sokoban.address, stats_scope=scope) as c:
        play_expert(c, "sokoban", [0] * 10, "no_think")           # train task 0: always solved
        stats_when(c, "sokoban", 10)
    build_tokenizer(["Solve the task. # _ P X O"]).save_pretrained(tmp_path)
    data_cfg = OmegaConf.create({
        "train_files": str(exported / "train.parquet"), "prompt_key": "prompt", "max_prompt_length": 1024,
        "return_raw_chat": True, "filter_overlong_prompts": False, "truncation": "error", "train_batch_size": 2,
        "dataloader_num_workers": 0, "seed": 0, "shuffle": True,
        "sampler": {"stats_scope": scope, "address": sokoban.address}})
    rows = RLHFDataset(data_files=data_cfg.train_files, tokenizer=AutoTokenizer.from_pretrained(tmp_path),
                       config=data_cfg)
    assert len(rows) == 5 and rows[2]["extra_info"]["seed"] == 2
    sampler = EnvServeTaskSampler(rows, data_cfg)
    assert len(sampler) == 4
    loader = DataLoader(rows, batch_size=2, sampler=sampler, collate_fn=collate_fn, drop_last=True)
    batches = [[int(e["seed"]) for e in b["extra_info"]] for b in loader]
    assert len(batches) == 2 and all(len(set(b)) == 2 for b in batches)   # a batch's rows: different tasks
    drawn = [i for _ in range(300) for i in sampler.tasks.draw_batch()]
    assert drawn.count(0) < min(drawn.count(i) for i in range(1, 5)) / 2


# -- the fleet route: FLEET=1 ----------------------------------------------------------------------
def test_the_fleet_route_runs_the_fleet_driver_and_exports_without_a_server(sokoban, dataset, tmp_path):
    """FLEET=1: verl's overrides go to main_ppo_fleet.py instead of main_ppo, and the dataset is
    exported by an in-process server (the fleet is not up yet), the same rows a replica lists."""
    data = tmp_path / "data"
    out = run_example([str(VERL / "run_sokoban.sh")],
                      env={"DRY_RUN": "1", "FLEET": "1", "PYTHON": sys.executable, "DATA": str(data),
                           "TRAIN_TASKS": "3", "VAL_TASKS": "1", "MODEL": "/models/tiny",
                           "ENVSERVE_ADDRESS": "127.0.0.1:9"}).stdout      # no one there: not used
    lines = out.splitlines()
    assert lines[0] == f"{sys.executable} {VERL / 'main_ppo_fleet.py'}"
    assert lines[1:] == [o.replace(str(dataset), str(data)) for o in dry_run(sokoban, dataset)]
    from envserve.client import EnvClient
    with EnvClient(sokoban.address) as c:
        listed = c.list_tasks("sokoban", "train", 3).tasks
    train = pd.read_parquet(data / "train.parquet")
    assert [e["task_id"] for e in train.extra_info] == [t.task_id for t in listed]
    assert (VERL / "main_ppo_fleet.py").exists() and "address" not in OmegaConf.load(VERL / "agent_loops.yaml")[0]


@verl_only
def test_the_fleet_driver_starts_a_fleet_and_runs_verls_main_ppo_on_its_ray(sokoban, dataset):
    """main_ppo_fleet.py on a Ray of its own: a real fleet of one Sokoban replica comes up, verl's
    main_ppo takes the recipe's overrides (hydra's --cfg job prints the composed config instead of
    training, which needs a GPU), and the fleet is drained at the end."""
    pytest.importorskip("verl")
    overrides = dry_run(sokoban, dataset)
    done = run_example(["verl/main_ppo_fleet.py", "--cfg", "job", *overrides], timeout=600,
                       env={"RAY_ADDRESS": "local", "FLEET_FAMILIES": "sokoban"})
    lines = [line.strip() for line in done.stdout.splitlines()]
    assert any(re.fullmatch(r"envserve fleet: sokoban replica ray-sokoban-\S+ at \S+:\d+", line) for line in lines), done.stdout
    # The composed config, as hydra prints it (the replicas' own log lines may come in between).
    assert f"agent_loop_config_path: {VERL / 'agent_loops.yaml'}" in lines
    assert "default_agent_loop: envserve_agent" in lines and f"train_files: {dataset / 'train.parquet'}" in lines
