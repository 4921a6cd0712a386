"""`areal-hpc train` with the login-node proxy's records as a second rollout source: sessions recorded
through a real proxy in front of a real server, then a short run that trains the rewarded records of
the chosen tenant, each once, beside its own rollouts, and saves the proxy cursor in its checkpoint.
"""

import json

import openai
import pytest

from areal_hpc.data.shards import TrajectoryStore
from tests.conftest import embedded_server, run_cli
from tests.proxy_helpers import call, proxy_config, running_proxy, start_session, write_keys
from tests.system.test_async_rl import run_dir, train_args

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


def test_a_run_trains_the_proxys_rewarded_records_of_its_tenant_once(tiny_model_dir, tmp_path):
    keys = tmp_path / "keys.yaml"
    write_keys(keys, {"alice": {"keys": ["tk-a"]}, "bob": {"keys": ["tk-b"]}})
    run = run_dir(tmp_path / "runs")
    sessions = {}
    with embedded_server(tiny_model_dir, tmp_path / "serve") as (_, server):
        cfg = proxy_config(tiny_model_dir, tmp_path / "proxy", [server], keys, f"proxy.shards_dir={run / 'shards'}")
        with running_proxy(cfg) as (base, _, _):
            for name, tenant_key, turns, reward in [
                ("rewarded", "tk-a", 2, 1.0),
                ("unrewarded", "tk-a", 1, None),
                ("other tenant", "tk-b", 1, 1.0),
                ("rewarded too", "tk-a", 1, 0.0),
            ]:
                session_id, key = start_session(base, tenant_key)
                client = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0)
                messages = [{"role": "user", "content": "What is 2+3?"}]
                for _ in range(turns):
                    reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4)
                    messages += [
                        {"role": "assistant", "content": reply.choices[0].message.content},
                        {"role": "user", "content": "Sure?"},
                    ]
                if reward is not None:
                    assert call(base, "/rl/set_reward", {"reward": reward}, key)[0] == 200
                assert call(base, "/rl/end_session", {}, key)[0] == 200
                sessions[name] = f"{session_id}-0"
    result = run_cli(
        *train_args(
            tiny_model_dir,
            tmp_path / "runs",
            "rl.total_train_steps=2",
            "rl.eval_every_steps=0",
            "rl.proxy_records_per_step=4",
            "rl.proxy_tenant=alice",
        ),
        "--resume=auto",
        timeout=400,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [json.loads(line) for line in (run / "logs" / "batches.jsonl").read_text().splitlines()]
    trained = [i for line in lines for i in line.get("trained", [])]
    assert len(trained) == len(set(trained)) == 2 * 4 * 4 + 2  # the run's own groups, then the proxy's two
    assert {sessions["rewarded"], sessions["rewarded too"]} <= set(trained)
    assert sessions["unrewarded"] not in trained and sessions["other tenant"] not in trained
    with TrajectoryStore(run / "shards") as store:
        (record,) = [t for t in store.trajectories() if t.id == sessions["rewarded"]]
        assert len(record.segments) == 2 and record.tenant == "alice"
    driver = json.loads((run / "checkpoints" / "step000002" / "driver.json").read_text())
    assert sum(len(v["extra"]) + v["next"] for v in driver["proxy_cursor"]["shards"].values()) >= 2
