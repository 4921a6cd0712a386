"""Config: defaults <- YAML <- overrides, and one clear error for every kind of bad input."""

import pytest

from areal_hpc.config import RunConfig, absolute_path_overrides, load_config, save_resolved, to_yaml
from areal_hpc.errors import UserError
from tests.conftest import REPO


def write(tmp_path, text: str):
    path = tmp_path / "exp.yaml"
    path.write_text(text)
    return str(path)


def test_defaults_yaml_and_overrides_merge_in_order(tmp_path):
    path = write(tmp_path, "actor: {lr: 2.0e-4}\nsft: {batch_size: 8}\nrollout: {workflow_args: {a: x, b: 2}}\n")
    cfg = load_config(path, ["actor.lr=1e-4", "generation.greedy=true", "rollout.workflow_args.b=3"])
    assert isinstance(cfg, RunConfig)
    assert cfg.actor.lr == 1e-4  # override beats YAML
    assert cfg.sft.batch_size == 8  # YAML beats default
    assert cfg.generation.greedy is True
    assert cfg.optimizer.beta1 == 0.9  # untouched default
    assert cfg.rollout.workflow_args == {"a": "x", "b": 3}  # a mapping's entry, set on its own


def test_areal_s_legacy_keys_are_read_as_the_current_ones_in_yaml_and_overrides(tmp_path):
    path = write(tmp_path, "gconfig: {top_p: 0.5, max_new_tokens: 12}\nactor: {kl_ctl: 0.2, lr: 2.0e-4}\n")
    cfg = load_config(path, ["gconfig.top_k=7", "actor.kl_ctl=0.3"])
    assert (cfg.generation.top_p, cfg.generation.max_new_tokens, cfg.generation.top_k) == (0.5, 12, 7)
    assert cfg.actor.kl_coef == 0.3 and cfg.actor.lr == 2.0e-4
    assert "gconfig" not in to_yaml(cfg) and "kl_ctl" not in to_yaml(cfg)  # the resolved config uses current names


@pytest.mark.parametrize(
    "text", ["gconfig: {top_p: 0.5}\ngeneration: {top_k: 3}\n", "actor: {kl_ctl: 0.1, kl_coef: 0.2}\n"]
)
def test_a_legacy_key_beside_its_current_name_is_refused_naming_both(tmp_path, text):
    with pytest.raises(UserError, match=r"config keys '(gconfig|actor\.kl_ctl)' and '(generation|actor\.kl_coef)'"):
        load_config(write(tmp_path, text))


def test_run_dir_follows_fileroot_experiment_and_trial(tmp_path):
    cfg = load_config(None, [f"cluster.fileroot={tmp_path}", "experiment.name=e", "experiment.trial=t"])
    assert cfg.run_dir == tmp_path / "e" / "t"


@pytest.mark.parametrize(
    "override, expected",
    [
        ("actor.lrr=1", "did you mean 'actor.lr'"),
        ("sft.bach_size=4", "did you mean 'sft.batch_size'"),
        ("optimizr.eps=1", "did you mean 'optimizer.eps'"),
    ],
)
def test_misspelt_override_names_the_closest_key(override, expected):
    with pytest.raises(UserError, match=expected):
        load_config(None, [override])


def test_misspelt_yaml_key_names_file_and_closest_key(tmp_path):
    path = write(tmp_path, "generation:\n  max_new_token: 4\n")
    with pytest.raises(
        UserError, match=r"'generation.max_new_token' in .*exp.yaml, did you mean 'generation.max_new_tokens'"
    ):
        load_config(path)


@pytest.mark.parametrize(
    "override, words",
    [
        ("sft.batch_size=many", ["sft.batch_size", "many", "int"]),
        ("dataset.task=chess", ["dataset.task", "chess", "arithmetic, countdown, gsm8k"]),
        ("sft.lr=0", ["sft.lr", "0", "> 0"]),
        ("generation.top_p=1.5", ["generation.top_p", "1.5", "<= 1"]),
        ("dataset.arithmetic=3", ["dataset.arithmetic", "section", "dataset.arithmetic.min_digits"]),
        ("rollout.failure_budget.max_rate=1.5", ["rollout.failure_budget.max_rate", "1.5", "<= 1"]),
        ("rollout.failure_budget.window=0", ["rollout.failure_budget.window", "0", ">= 1"]),
        ("rollout.failure_budget.exit_code_on_failures=75", ["exit_code_on_failures", "75", "<= 74"]),  # requeues
        ("rollout.failure_budget=8", ["rollout.failure_budget", "section", "rollout.failure_budget.max_consecutive"]),
        ("no_equals_sign", ["no_equals_sign", "key=value"]),
    ],
)
def test_bad_values_name_key_value_and_what_is_allowed(override, words):
    with pytest.raises(UserError) as err:
        load_config(None, [override])
    message = str(err.value)
    assert "\n" not in message
    for word in words:
        assert word in message


@pytest.mark.parametrize(
    "text, words",
    [
        ("- just\n- a list\n", ["mapping"]),
        ("sft: {batch_size: [1, 2\n", ["not valid YAML"]),
        ("model: tiny\n", ["'model'", "section"]),
    ],
)
def test_malformed_yaml_files_are_user_errors(tmp_path, text, words):
    with pytest.raises(UserError) as err:
        load_config(write(tmp_path, text))
    assert all(w in str(err.value) for w in words)


def test_missing_config_file_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="config file not found"):
        load_config(str(tmp_path / "nope.yaml"))


def test_resolved_config_is_saved_next_to_outputs_and_reloads_identically(tmp_path):
    cfg = load_config(None, [f"cluster.fileroot={tmp_path}", "actor.lr=3e-5", "dataset.arithmetic.ops=+-"])
    saved = save_resolved(cfg)
    assert saved == cfg.run_dir / "config.yaml"
    assert load_config(str(saved)) == cfg


@pytest.mark.parametrize("name", sorted(p.name for p in (REPO / "configs").glob("*.yaml")))
def test_shipped_configs_load(name):
    load_config(str(REPO / "configs" / name))


@pytest.mark.parametrize("trial", ["04718e80", "1e3", "007", "true", "null"])
def test_text_overrides_stay_as_typed(trial):
    assert load_config(None, [f"experiment.trial={trial}", "actor.lr=1e-3"]).experiment.trial == trial


def test_the_failure_budget_is_built_from_its_config_section():
    from areal_hpc.rollout.controller import FailureBudget

    cfg = load_config(
        None,
        [
            "rollout.failure_budget.max_consecutive=0",
            "rollout.failure_budget.window=50",
            "rollout.failure_budget.max_rate=0.25",
        ],
    )
    assert FailureBudget.from_config(cfg.rollout.failure_budget) == FailureBudget(0, 50, 0.25)
    assert FailureBudget.from_config(load_config().rollout.failure_budget) == FailureBudget()  # same defaults


def test_a_submitted_projects_relative_paths_and_file_specs_become_absolute(tmp_path, monkeypatch):
    """What ``areal-hpc submit`` writes into the job's config (a job starts on other nodes, in another
    folder): relative data paths and ``file.py:name`` specs resolved from the submitting folder; module
    specs and built-in names kept. tests/agents/test_agent_program.py submits such a project for real."""
    monkeypatch.chdir(tmp_path)
    cfg = load_config(
        None,
        [
            "dataset.path=project/sticks.parquet",
            "reward.fn=project/my_reward.py:reward",
            "rollout.workflow=project/my_agent.py:AskTwice",
            "actor.engine=torch",
        ],
    )
    assert sorted(absolute_path_overrides(cfg)) == sorted(
        [
            f"cluster.fileroot={tmp_path / 'runs'}",  # the default, relative too
            f"dataset.path={tmp_path / 'project' / 'sticks.parquet'}",
            f"reward.fn={tmp_path / 'project' / 'my_reward.py'}:reward",
            f"rollout.workflow={tmp_path / 'project' / 'my_agent.py'}:AskTwice",
        ]
    )
