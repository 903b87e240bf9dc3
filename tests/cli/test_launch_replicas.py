"""`shardtrain launch`'s replica-group flags: the variables `fault_tolerance` reads, or one line and exit 2."""

import json
import subprocess
import sys

from launch import worker_env


def launch(tmp_path, *flags):
    script = tmp_path / "train.py"
    script.write_text("")
    return subprocess.run([sys.executable, "-m", "shardtrain.cli.main", "launch", "--cpu", "--num_processes", "1",
                           *flags, "--dry_run", str(script)], capture_output=True, text=True, env=worker_env())


def test_the_flags_become_the_variables_fault_tolerance_reads(tmp_path):
    done = launch(tmp_path, "--replica_group_id", "1", "--num_replica_groups", "3", "--lighthouse", "http://h:29510")
    assert done.returncode == 0, done.stderr
    env = json.loads(done.stdout)["env"]
    assert (env["SHARDTRAIN_REPLICA_GROUP"], env["SHARDTRAIN_REPLICA_GROUPS"], env["TORCHFT_LIGHTHOUSE"]) == \
        ("1", "3", "http://h:29510")
    from shardtrain.config.fault_tolerance import FaultTolerance

    settings = FaultTolerance.resolve(None, env)
    assert (settings.replica_group, settings.replica_groups) == (1, 3)


def test_a_group_outside_the_job_or_a_missing_flag_is_one_line(tmp_path):
    done = launch(tmp_path, "--replica_group_id", "3", "--num_replica_groups", "2", "--lighthouse", "http://h:1")
    assert done.returncode == 2 and done.stderr.strip() == \
        "error: --replica_group_id 3 is not one of the 2 groups (0 .. 1)"
    done = launch(tmp_path, "--replica_group_id", "0")
    assert done.returncode == 2 and "need --replica_group_id, --num_replica_groups and --lighthouse together" in \
        done.stderr
