"""Tests: no run loses, mixes or silently truncates results, and no input that passed the checks ends in a
traceback: the --out lock, a checkpoint rotation killed at every step, --overwrite, interrupts, failed writes,
the shape of what --resume reads, the SFT length cap and non-finite guard, and fast offline failures."""
import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

import checkpoint
import start
import test_vine
import train
from reward import DataError
from test_vine import HERE, OFFLINE, SMALL, numbers, run_train

# ---- the checkpoint rotation, killed at every step --------------------------------------------


class Killed(BaseException):
    """A kill: no handler of the code under test runs (it catches Exception only)."""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny"))
    checkpoint.build_tiny_model(path, seed=0)
    return checkpoint.load_model(path, "cpu")  # (tokenizer, model)


def save(out, tiny, iteration: int):
    tok, model = tiny
    checkpoint.save_checkpoint(str(out), model, tok, {"iteration": iteration})


def complete_iteration(path) -> int:
    """The iteration of a checkpoint whose every file is there and reads, else an assertion error."""
    assert sorted(os.listdir(path)) == ["config.json", "generation_config.json", "model.safetensors",
                                        "tokenizer.json", "tokenizer_config.json", "trainer_state.pt"]
    load_file(os.path.join(path, "model.safetensors"))
    json.load(open(os.path.join(path, "tokenizer.json")))
    return torch.load(os.path.join(path, "trainer_state.pt"), weights_only=True)["iteration"]


def kill_at(monkeypatch, n: int):
    """The n-th file-system step of a save (an os.replace, a shutil.rmtree, the writing of the new
    checkpoint) is killed halfway: a rename never happens, a removal takes the weights only, a write
    leaves the weights without the trainer state."""
    count = [0]

    def step(real, halfway):
        def run(path, *args, **kwargs):
            count[0] += 1
            if count[0] == n:
                halfway(path, *args)
                raise Killed
            return real(path, *args, **kwargs)
        return run

    def remove_weights(path, *args):
        if os.path.exists(os.path.join(path, "model.safetensors")):
            os.remove(os.path.join(path, "model.safetensors"))

    monkeypatch.setattr(os, "replace", step(os.replace, lambda *args: None))
    monkeypatch.setattr(shutil, "rmtree", step(shutil.rmtree, remove_weights))
    weights_only = lambda path, policy, *rest: policy.save_pretrained(path)
    monkeypatch.setattr(checkpoint, "write_checkpoint", step(checkpoint.write_checkpoint, weights_only))


LEFTOVERS = {  # what earlier kills leave, each on top of a complete checkpoint/ at iteration 1
    "none": lambda out: None,
    "old copy": lambda out: shutil.copytree(out / "checkpoint", out / "checkpoint.old"),  # issue: Errno 39
    "torn tmp": lambda out: shutil.copytree(out / "checkpoint", out / "checkpoint.tmp",
                                            ignore=lambda folder, names: ["trainer_state.pt"]),
    "between renames": lambda out: os.replace(out / "checkpoint", out / "checkpoint.old"),
}


@pytest.mark.parametrize("leftover", LEFTOVERS)
def test_a_kill_at_any_step_of_a_save_leaves_a_complete_checkpoint(tmp_path, tiny, monkeypatch, leftover):
    """For each step n of the save of iteration 2: killed there, the last checkpoint is complete (iteration
    1 or 2), and the next save succeeds and leaves nothing else behind."""
    template = tmp_path / "template"
    save(template, tiny, 1)
    LEFTOVERS[leftover](template)
    for n in range(1, 100):
        out = tmp_path / f"kill{n}"
        shutil.copytree(template, out)
        kill_at(monkeypatch, n)
        try:
            save(out, tiny, 2)
            killed = False
        except Killed:
            killed = True
        monkeypatch.undo()
        assert complete_iteration(checkpoint.last_checkpoint(str(out))) in ((1, 2) if killed else (2,))
        save(out, tiny, 3)
        assert complete_iteration(checkpoint.last_checkpoint(str(out))) == 3
        assert sorted(os.listdir(out)) == ["checkpoint"]
        if not killed:  # every step has been killed once
            break
    assert n > 4


def test_a_failed_write_is_one_line_and_keeps_the_last_checkpoint(tmp_path, tiny, monkeypatch):
    save(tmp_path, tiny, 1)

    def full_disk(*args, **kwargs):
        raise RuntimeError("[enforce fail at inline_container.cc:672] PytorchStreamWriter failed writing file")
    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(OSError, match=r"cannot write .*checkpoint\.tmp \(\[enforce fail.*\)$"):
        save(tmp_path, tiny, 2)
    assert complete_iteration(tmp_path / "checkpoint") == 1 and sorted(os.listdir(tmp_path)) == ["checkpoint"]


# ---- one run at a time in an --out; --overwrite --------------------------------------------


def test_a_second_run_into_a_locked_out_is_refused_in_one_line(tmp_path):
    """The lock of a run that is still going (held here) refuses train.py; a lock left by a killed process,
    or a lock file naming a dead process, is taken over."""
    with open(tmp_path / ".lock", "w") as held:
        held.write("pid 12345 on elsewhere\n")
        held.flush()
        fcntl.flock(held, fcntl.LOCK_EX)
        r = subprocess.run([sys.executable, os.path.join(HERE, "train.py"), "--out", str(tmp_path), *SMALL],
                           env=OFFLINE, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr[-2000:]
    assert f"--out '{tmp_path}' is in use by a run that is still going (pid 12345 on elsewhere)" in r.stderr
    assert not (tmp_path / "tiny-init").exists()  # refused before anything is written
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, sys, time; f = open(sys.argv[1], 'a'); "
                               "fcntl.flock(f, fcntl.LOCK_EX); print(1, flush=True); time.sleep(60)",
                               str(tmp_path / ".lock")], stdout=subprocess.PIPE)
    assert holder.stdout.readline()  # it holds the lock
    with pytest.raises(DataError, match="is in use"):
        start.lock_out(str(tmp_path))
    holder.kill()  # SIGKILL: the OS releases its lock
    holder.wait()
    start.lock_out(str(tmp_path))
    assert (tmp_path / ".lock").read_text().startswith(f"pid {os.getpid()} on ")
    start.held_lock.close()


def test_overwrite_removes_all_of_the_earlier_run_before_writing(tmp_path):
    """Killed right after --overwrite cleared the earlier run, a --resume starts afresh: nothing of the old
    run (its checkpoint above all) is left to continue from. Files that are not the run's stay."""
    for name in checkpoint.RESULTS + checkpoint.LEFTOVERS:
        if name.endswith((".jsonl", ".tmp")) and "checkpoint" not in name and "reference" not in name:
            (tmp_path / name).write_text('{"iteration": 0}\n')
        else:
            (tmp_path / name).mkdir()
            (tmp_path / name / "trainer_state.pt").write_bytes(b"x")
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(DataError, match="holds an earlier run"):
        start.prepare_out(train.parse_args(["--out", str(tmp_path)]))
    start.prepare_out(train.parse_args(["--out", str(tmp_path), "--overwrite"]))
    assert sorted(os.listdir(tmp_path)) == [".lock", "notes.txt"]
    assert checkpoint.find_resume(train.parse_args(["--out", str(tmp_path), "--resume"])) == (None, None)
    start.held_lock.close()


# ---- interrupts and failed writes end in one line -------------------------------------------


def stopped_run(out, signum):
    """train.py sent `signum` once its first checkpoint is written (after iteration 1; one every iteration)."""
    proc = subprocess.Popen([sys.executable, os.path.join(HERE, "train.py"), "--out", str(out), *SMALL,
                             "--iterations", "3"], cwd=HERE, env=OFFLINE, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if (out / "checkpoint").exists():
            break
        time.sleep(0.02)
    proc.send_signal(signum)
    return proc


def test_ctrl_c_sigterm_and_a_full_disk_end_in_one_line_naming_the_checkpoint(tmp_path):
    script = ("import runpy, sys, torch\nsaved = torch.save\n"  # the second trainer state meets a full disk
              "def save(obj, path, *a, n=[0]):\n    n[0] += 1\n"
              "    if n[0] == 2: raise OSError(28, 'No space left on device')\n    saved(obj, path, *a)\n"
              "torch.save = save\nsys.argv = sys.argv[1:]\nrunpy.run_path(sys.argv[0], run_name='__main__')\n")
    full = subprocess.Popen([sys.executable, "-c", script, os.path.join(HERE, "train.py"), "--out",
                             str(tmp_path / "full"), *SMALL], cwd=HERE, env=OFFLINE, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    runs = {"SIGINT": stopped_run(tmp_path / "int", signal.SIGINT),
            "SIGTERM": stopped_run(tmp_path / "term", signal.SIGTERM)}
    for name, proc in runs.items():
        err = proc.communicate(timeout=300)[1]
        assert proc.returncode == 128 + signal.Signals[name] and "Traceback" not in err, err[-3000:]
        out = tmp_path / ("int" if name == "SIGINT" else "term")
        assert err.splitlines()[-1] in (
            f"stopped by {name}; the last checkpoint is {out / 'checkpoint'}: --resume (in place of any "
            "--overwrite) continues from it", f"stopped by {name}; the last checkpoint is "
            f"{out / 'checkpoint.old'}: --resume (in place of any --overwrite) continues from it")
    err = full.communicate(timeout=300)[1]
    assert full.returncode == 1 and "Traceback" not in err, err[-3000:]
    full_out = tmp_path / "full"
    assert err.splitlines()[-1] == (f"error: cannot write {full_out / 'checkpoint.tmp'} ([Errno 28] No space "
                                    f"left on device); the last checkpoint is {full_out / 'checkpoint'}: "
                                    "--resume (in place of any --overwrite) continues from it")
    assert complete_iteration(tmp_path / "full" / "checkpoint") == 1
    resumed = run_train("--out", str(tmp_path / "term"), *SMALL, "--iterations", "3", "--resume")
    assert resumed.returncode == 0 and [row["iteration"] for row in numbers(tmp_path / "term")] == [0, 1, 2, 3]


# ---- what --resume reads, checked by shape --------------------------------------------------


def test_metrics_rows_torn_last_line_dropped_any_other_bad_line_refused(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"iteration": 0}\n{"iteration": 1, "x": 2}\n{"iteration": 2}\n{"iteration": 3, "tr')
    assert checkpoint.rows_up_to(str(path), 1) == ['{"iteration": 0}\n', '{"iteration": 1, "x": 2}\n']
    not_utf8 = b'{"iteration": 1, "s": "\xff"}'
    for bad in (b'{"note": "x"}', b'{"iteration": "1"}', b'[1, 2]', b'not json', not_utf8, b''):
        path.write_bytes(b'{"iteration": 0}\n' + bad + b'\n{"iteration": 1}\n')
        with pytest.raises(DataError, match=f"{path}:2: expected a row of this run"):
            checkpoint.rows_up_to(str(path), 1)


@pytest.mark.parametrize("state, message", [
    ({}, "is not a trainer state (no int 'iteration')"),
    ([1, 2], "is not a trainer state (no int 'iteration')"),
    ({"iteration": 1, "config": {}, "rng": []}, "is not a trainer state (no list 'optimizers')"),
])
def test_a_trainer_state_of_the_wrong_shape_is_refused_in_one_line(tmp_path, state, message):
    (tmp_path / "checkpoint").mkdir()
    torch.save(state, tmp_path / "checkpoint" / "trainer_state.pt")
    with pytest.raises(DataError, match=r"--resume: .*trainer_state.pt " + re.escape(message)):
        checkpoint.find_resume(train.parse_args(["--out", str(tmp_path), "--resume"]))


@pytest.mark.parametrize("settings, message", [
    (None, "cannot be read"), ("{", "cannot be read"),
    ('{"model": "tiny"}', "is not a run's settings (no --iterations)"),
])
def test_resume_checks_the_runs_settings_file(tmp_path, settings, message):
    """OUT/config.json is what --resume compares a continued run with: missing or damaged, one line."""
    (tmp_path / "checkpoint").mkdir()
    torch.save({"iteration": 1, "optimizers": [], "rng": []}, tmp_path / "checkpoint" / "trainer_state.pt")
    if settings is not None:
        (tmp_path / "config.json").write_text(settings)
    resume = train.parse_args(["--out", str(tmp_path), "--resume", "--iterations", "3"])
    with pytest.raises(DataError, match=r"^--resume: .*config.json " + re.escape(message)):
        checkpoint.find_resume(resume)
    checkpoint.record_settings(train.parse_args(["--out", str(tmp_path), "--iterations", "2", "--seed", "1"]))
    with pytest.raises(DataError, match=rf"^--resume: {tmp_path} was written with --seed 1, not 0$"):
        checkpoint.find_resume(resume)
    written = json.loads((tmp_path / "config.json").read_text())  # every setting, not only those changed
    assert set(written) == set(vars(train.Config())) and (written["iterations"], written["seed"]) == (2, 1)


def test_a_damaged_checkpoint_is_named_as_the_runs_not_as_model(tmp_path, tiny):
    save(tmp_path, tiny, 1)
    weights = tmp_path / "checkpoint" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # truncated
    for path in (tmp_path / "checkpoint", tmp_path / "reference"):
        with pytest.raises(DataError, match=rf"^--resume: {path} cannot be loaded \(.+\); --overwrite starts"):
            checkpoint.load_model(str(path), "cpu", resuming=True)
    (tmp_path / "checkpoint" / "critic").mkdir()  # a PPO checkpoint whose critic is damaged
    with pytest.raises(DataError, match=r"^--resume: .*critic cannot be loaded"):
        checkpoint.load_critic(str(tmp_path / "checkpoint"), "cpu")


# ---- settings and data the code can hold ----------------------------------------------------


@pytest.mark.parametrize("args, message", [
    (["--seed", "100000000000000000000"], "--seed 100000000000000000000: expected an int64"),
    (["--seed", "-1"], "--seed -1: expected 0 <= SEED < 2**63"),
    (["--clip", "1e300"], "--clip 1e+300: expected a finite float32"),
    (["--algo", "ppo", "--value-clip", "1e300"], "--value-clip 1e+300: expected a finite float32"),
    (["--temperature", "1e-300"], "--temperature 1e-300: expected >= 0.001"),
    (["--eval-temperature", "1e-9"], "--eval-temperature 1e-09: expected 0 (greedy) or >= 0.001"),
    (["--lr", "1e39"], "--lr 1e+39: expected a finite float32"),
    (["--resume", "--overwrite"], "--resume and --overwrite: pick one"),
])
def test_settings_the_tensors_cannot_hold_are_refused(capsys, args, message):
    test_vine.test_bad_setting_gives_one_line_error(capsys, args, message)
    train.parse_args(["--seed", str(2**63 - 1), "--clip", "1e30", "--eval-temperature", "0"])  # the limits pass


def test_sft_examples_capped_at_what_rl_holds_with_a_count(tiny, capsys):
    tok, _ = tiny
    problems = [{"prompt": "What is 1+1?\n", "answer": "1+1=2\n#### 2"},
                {"prompt": "What is 2+2?\n", "answer": "2+2=4\n" * 2000 + "#### 4"}]  # a 12 KB answer
    examples = start.sft_examples(tok, problems, max_tokens=1576)
    (ids, _), = examples
    assert examples == start.sft_examples(tok, problems[:1], 1576) and len(ids) <= 1576
    assert ("sft: skipped 1 of 2 training problems: prompt and solution over --max-prompt-tokens + "
            "--max-new-tokens = 1576 tokens") in capsys.readouterr().out
    with pytest.raises(DataError, match=r"--max-new-tokens = 20: every training problem's SFT example"):
        start.sft_examples(tok, problems, max_tokens=20)


def test_sft_skips_a_non_finite_step_as_rl_does(tmp_path, capsys):
    """A NaN loss at the first SFT step: that step is skipped and counted, the weights stay finite, and the
    other steps train them."""
    checkpoint.build_tiny_model(str(tmp_path), seed=0)
    tok, model = checkpoint.load_model(str(tmp_path), "cpu")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    calls = []

    def nan_first(module, args, kwargs, output):
        calls.append(1)
        if len(calls) == 1:
            output.loss = output.loss * float("nan")
        return output
    model.register_forward_hook(nan_first, with_kwargs=True)
    cfg = train.parse_args(["--sft-steps", "3", "--sft-batch", "4"])
    problems = [{"prompt": f"What is {i}+1?\n", "answer": f"{i}+1={i + 1}\n#### {i + 1}"} for i in range(8)]
    cpu = torch.device("cpu")
    start.sft_warm_start(model, tok, problems, cfg, cpu, start.autocast(cpu, "fp32"))
    assert "warning: sft: 1 of 3 steps skipped: non-finite loss or gradient" in capsys.readouterr().out
    weights = model.state_dict()
    assert all(torch.isfinite(w).all() for w in weights.values())
    assert any(not torch.equal(weights[k], before[k]) for k in before)
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())  # none left for RL


def test_prompts_per_iter_above_the_training_set_is_said_and_sizes_the_schedule(capsys):
    cfg = train.parse_args(["--prompts-per-iter", "5000"])
    start.fit_prompts_per_iter(cfg, 2000)
    assert cfg.prompts_per_iter == 2000
    said = capsys.readouterr().out
    assert "--prompts-per-iter 5000: the training set has 2000 problems; 2000 an iteration" in said
    start.fit_prompts_per_iter(cfg, 2000)  # what fits is left as it is
    assert cfg.prompts_per_iter == 2000 and capsys.readouterr().out == ""


def test_an_unreachable_hub_fails_fast_in_one_line(tmp_path):
    """The hub libraries retry an unreachable hub for ~25 s a file, printing each retry: one quick look
    instead, then one line. The hub is made unreachable (a closed local port) whatever the network."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))}
    env.update(HF_ENDPOINT="http://127.0.0.1:9", HF_HOME=str(tmp_path / "hf"))
    train_py = os.path.join(HERE, "train.py")
    runs = [subprocess.Popen([sys.executable, train_py, "--out", str(tmp_path / name), *args], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for name, args in (("model", ["--model", "some-org/some-model"]), ("data", ["--data", "gsm8k"]),
                               ("math", ["--data", "math"]))]
    for proc, message in zip(runs, ("error: --model 'some-org/some-model': cannot load it",
                                    "error: --data gsm8k: cannot load openai/gsm8k from the hub",
                                    "error: --data math: cannot load zzy1123/MATH_train_test_split")):
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 2 and err.startswith(message) and err.count("\n") == 1, err[-3000:]
        assert "cannot be reached" in out
