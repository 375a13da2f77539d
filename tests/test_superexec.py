"""tools.superexec: ClientApp tasks run in a child of a warm fork server, with exactly the
arguments ``flwr-clientapp`` would pass to Flower's ``run_clientapp``; other tasks go to Flower's
subprocess executor. (The deployment test runs it for real, behind every SuperNode.)"""

from __future__ import annotations

import json
import os
import sys

from flwr.supercore.constant import TaskType
from flwr.supercore.superexec.executor import ExecutionSpec, LaunchResultStatus

import tools.superexec
from tools.deploy import write_certificates


def record_call(**kwargs) -> None:
    """Stands in for ``run_clientapp`` in the forked child: writes what it was given, and what the
    child had imported before it ran, to the file named by the task's token."""
    kwargs["certificates"] = kwargs["certificates"].decode() if kwargs["certificates"] else None
    seen = {"kwargs": kwargs, "parent": os.getppid(), "torch_preloaded": "torch" in sys.modules}
    with open(kwargs["token"], "w") as f:
        json.dump(seen, f)


def spec(
    task_type: TaskType, token: str, root_certificates_path: str | None = None, suppress_output: bool = False
) -> ExecutionSpec:
    return ExecutionSpec(
        task_type=task_type,
        runtime_api_address="127.0.0.1:9094",
        token=token,
        insecure=root_certificates_path is None,
        root_certificates_path=root_certificates_path,
        runtime_dependency_install=False,
        parent_pid=os.getpid(),
        suppress_output=suppress_output,
        task_id=7,
    )


def test_a_clientapp_task_forks_from_the_warm_server_with_flwr_clientapps_arguments(tmp_path, monkeypatch):
    monkeypatch.setattr(tools.superexec, "run_clientapp", record_call)
    ca = write_certificates(tmp_path / "certs", [], [])["ca"]
    executor = tools.superexec.ForkserverExecutor(preload=("torch",))
    out = tmp_path / "call.json"
    result = executor.launch(spec(TaskType.CLIENT_APP, str(out), str(ca)))
    assert result.status == LaunchResultStatus.ACCEPTED
    (child,) = executor.children
    child.join(60)
    assert child.exitcode == 0
    seen = json.loads(out.read_text())
    assert seen["kwargs"] == {
        "runtime_api_address": "127.0.0.1:9094",
        "token": str(out),
        "insecure": False,
        "certificates": ca.read_text(),  # read in the SuperExec, as flwr-clientapp reads --root-certificates
        "parent_pid": os.getpid(),
        "runtime_dependency_install": False,
    }
    assert seen["parent"] != os.getpid()  # forked by the fork server, not by the SuperExec
    assert seen["torch_preloaded"]  # imported once by the fork server, not by the task
    executor.reconcile()
    assert executor.children == []  # finished children are reaped


def test_other_tasks_and_silenced_ones_start_as_with_flowers_executor(monkeypatch):
    started = []
    monkeypatch.setattr("subprocess.Popen", lambda args, **kw: started.append(args))
    executor = tools.superexec.ForkserverExecutor()
    for task in (spec(TaskType.SERVER_APP, "tok"), spec(TaskType.CLIENT_APP, "tok", suppress_output=True)):
        assert executor.launch(task).status == LaunchResultStatus.ACCEPTED
    assert [args[0] for args in started] == ["flwr-serverapp", "flwr-clientapp"]
    assert all(args[args.index("--token") + 1] == "tok" for args in started)
    assert executor.children == []
