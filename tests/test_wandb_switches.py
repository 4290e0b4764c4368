"""W&B follows its own switches and credentials under `wandb.mode: auto`: WANDB_MODE (disabled writes nothing),
WANDB_DISABLED, WANDB_API_KEY, and the netrc entry `wandb login` leaves; an explicit `wandb.mode` wins over them."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import wandb
from conftest import TESTS_DIR, small_config

from grpo_dist.config import validate_config
from grpo_dist.run.metrics import start_wandb, wandb_mode

SWITCHES = ("WANDB_MODE", "WANDB_DISABLED", "WANDB_API_KEY", "WANDB_BASE_URL", "NETRC")


@pytest.fixture
def no_switches(monkeypatch, tmp_path):
    for name in SWITCHES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    return monkeypatch


@pytest.mark.parametrize(
    ("environment", "netrc", "mode"),
    [
        ({}, None, "offline"),
        ({"WANDB_MODE": "disabled"}, None, "disabled"),
        ({"WANDB_MODE": "offline", "WANDB_API_KEY": "k" * 40}, None, "offline"),
        ({"WANDB_MODE": "dryrun"}, None, "offline"),
        ({"WANDB_DISABLED": "true"}, None, "disabled"),
        ({"WANDB_API_KEY": "k" * 40}, None, "online"),
        ({}, "machine api.wandb.ai\n  login user\n  password " + "p" * 40 + "\n", "online"),
        ({}, "machine example.org\n  login user\n  password " + "p" * 40 + "\n", "offline"),  # another host's
        ({"WANDB_BASE_URL": "https://wandb.example.org"}, "machine wandb.example.org login u password pw\n", "online"),
    ],
    ids=["nothing", "disabled", "offline-wins-over-a-key", "dryrun", "wandb-disabled", "api-key", "wandb-login",
         "netrc-of-another-host", "own-server-login"],
)  # fmt: skip
def test_auto_follows_wandbs_own_switches_and_credentials(no_switches, tmp_path, environment, netrc, mode):
    for name, value in environment.items():
        no_switches.setenv(name, value)
    if netrc is not None:
        (tmp_path / "netrc").write_text(netrc)
        no_switches.setenv("NETRC", str(tmp_path / "netrc"))
    assert wandb_mode("auto") == mode
    assert wandb_mode("offline") == "offline"  # a mode the config names is the mode
    assert wandb_mode("disabled") == "disabled"


def test_wandb_mode_disabled_writes_nothing_and_auto_without_credentials_writes_offline(no_switches, tmp_path):
    no_switches.delenv("WANDB_SERVICE", raising=False)  # wandb sets it for this process: gone with the test
    cfg = validate_config(small_config(tmp_path, wandb={"enabled": True, "mode": "auto"}))
    no_switches.setenv("WANDB_MODE", "disabled")
    assert start_wandb(cfg, tmp_path / "disabled") is None
    assert not (tmp_path / "disabled").exists() or not any((tmp_path / "disabled").iterdir())
    no_switches.delenv("WANDB_MODE")
    (tmp_path / "offline").mkdir()
    run = start_wandb(cfg, tmp_path / "offline")
    try:
        assert run is not None and run.settings.mode == "offline"
    finally:
        run.finish()
        wandb.teardown()  # its service too: later processes of this test run must not inherit it
    assert list((tmp_path / "offline" / "wandb").glob("offline-run-*"))


RUN = """
import os, sys
from pathlib import Path
from conftest import small_config
from grpo_dist.config import validate_config
from grpo_dist.run.metrics import start_wandb
cfg = validate_config(small_config(Path(sys.argv[1]), wandb={"enabled": True, "mode": "offline"}))
run = start_wandb(cfg, Path(sys.argv[1]), "samerun01")
print("logged", flush=True)
if sys.argv[2] == "killed":
    os._exit(0)  # as SIGKILL: the run never finishes
run.finish()
"""


def test_a_run_killed_under_a_parents_wandb_service_resumes_its_wandb_run(no_switches, tmp_path):
    """A driver started by a process that used wandb inherits its service (WANDB_SERVICE). A run killed there left
    its run id held by that service, and the resumed run was refused ("run ID ... is in use"); each run now starts a
    service of its own."""
    env = {k: v for k, v in os.environ.items() if k != "WANDB_SERVICE"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS_DIR), env.get("PYTHONPATH")]))
    holder = subprocess.Popen([sys.executable, "-c", "import os, time, wandb; wandb.setup(); "
                               "print(os.environ['WANDB_SERVICE'], flush=True); time.sleep(300)"],
                              stdout=subprocess.PIPE, text=True, env=env)  # fmt: skip
    try:
        env["WANDB_SERVICE"] = holder.stdout.readline().strip()
        assert env["WANDB_SERVICE"]
        (tmp_path / "run").mkdir()
        for how in ("killed", "resumed"):
            done = subprocess.run([sys.executable, "-c", RUN, str(tmp_path / "run"), how], env=env, cwd=tmp_path,
                                  capture_output=True, text=True, timeout=300)  # fmt: skip
            assert done.returncode == 0 and "logged" in done.stdout, (how, done.stderr[-2000:])
    finally:
        holder.kill()
        holder.wait()
