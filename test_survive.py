"""Tests: no run loses, mixes or silently truncates results, and no input that passed the checks
ends in a traceback: the --out lock, a checkpoint rotation killed at every step, --overwrite,
interrupts, failed writes, the shape of what --resume reads and what it may change, the folders
the tools may write into, the SFT length cap and non-finite guard, and fast offline failures."""
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

import rollout
import test_vine
import train
from engineering import checkpoint, models, outputs, prompts, sft, start
from engineering.tasks import DataError
from test_vine import HERE, OFFLINE, SMALL, numbers, run_train

# ---- the checkpoint rotation, killed at every step --------------------------------------------


class Killed(BaseException):
    """A kill: no handler of the code under test runs (it catches Exception only)."""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny"))
    models.build_tiny_model(path, seed=0)
    return models.load_model(path, "cpu")  # (tokenizer, model)


def save(out, tiny, iteration: int):
    tok, model = tiny
    checkpoint.save_checkpoint(str(out), model, tok, {"iteration": iteration})


def complete_iteration(path) -> int:
    """The iteration of a checkpoint whose every file is there and reads, else an assertion
    error."""
    assert sorted(os.listdir(path)) == ["config.json", "generation_config.json",
                                        "model.safetensors", "tokenizer.json",
                                        "tokenizer_config.json", "trainer_state.pt"]
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
    monkeypatch.setattr(checkpoint, "write_checkpoint",
                        step(checkpoint.write_checkpoint, weights_only))


LEFTOVERS = {  # what earlier kills leave, each on top of a complete checkpoint/ at iteration 1
    "none": lambda out: None,
    # issue: Errno 39
    "old copy": lambda out: shutil.copytree(out / "checkpoint", out / "checkpoint.old"),
    "torn tmp": lambda out: shutil.copytree(out / "checkpoint", out / "checkpoint.tmp",
                                            ignore=lambda folder, names: ["trainer_state.pt"]),
    "between renames": lambda out: os.replace(out / "checkpoint", out / "checkpoint.old"),
}


@pytest.mark.parametrize("leftover", LEFTOVERS)
def test_a_kill_at_any_step_of_a_save_leaves_a_complete_checkpoint(tmp_path, tiny, monkeypatch,
                                                                   leftover):
    """For each step n of the save of iteration 2: killed there, the last checkpoint is complete
    (iteration 1 or 2), and the next save succeeds and leaves nothing else behind."""
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
        assert (complete_iteration(checkpoint.last_checkpoint(str(out)))
                in ((1, 2) if killed else (2,)))
        save(out, tiny, 3)
        assert complete_iteration(checkpoint.last_checkpoint(str(out))) == 3
        assert sorted(os.listdir(out)) == ["checkpoint"]
        if not killed:  # every step has been killed once
            break
    assert n > 4


def test_a_failed_write_is_one_line_and_keeps_the_last_checkpoint(tmp_path, tiny, monkeypatch):
    save(tmp_path, tiny, 1)

    def full_disk(*args, **kwargs):
        raise RuntimeError("[enforce fail at inline_container.cc:672] PytorchStreamWriter failed "
                           "writing file")
    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(OSError, match=r"cannot write .*checkpoint\.tmp \(\[enforce fail.*\)$"):
        save(tmp_path, tiny, 2)
    assert (complete_iteration(tmp_path / "checkpoint") == 1
            and sorted(os.listdir(tmp_path)) == ["checkpoint"])


# ---- one run at a time in an --out; --overwrite --------------------------------------------


@pytest.mark.slow
def test_a_second_run_into_a_locked_out_is_refused_in_one_line(tmp_path):
    """The lock of a run that is still going (held here) refuses train.py; a lock left by a killed
    process, or a lock file naming a dead process, is taken over."""
    with open(tmp_path / ".lock", "w") as held:
        held.write("pid 12345 on elsewhere\n")
        held.flush()
        fcntl.flock(held, fcntl.LOCK_EX)
        r = subprocess.run([sys.executable, os.path.join(HERE, "train.py"), "--out", str(tmp_path),
                            *SMALL],
                           env=OFFLINE, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr[-2000:]
    assert (f"--out '{tmp_path}' is in use by a run that is still going (pid 12345 on elsewhere)"
            in r.stderr)
    assert not (tmp_path / "tiny-init").exists()  # refused before anything is written
    holder = subprocess.Popen([sys.executable, "-c",
                               "import fcntl, sys, time; f = open(sys.argv[1], 'a'); "
                               "fcntl.flock(f, fcntl.LOCK_EX); print(1, flush=True); "
                               "time.sleep(60)",
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
    """Killed right after --overwrite cleared the earlier run, a --resume starts afresh: nothing of
    the old run (its checkpoint above all) is left to continue from. The other tools' files
    stay (diagnose.py's). The removal is not prepare_out's: that comes before anything that can
    refuse the run."""
    for name in outputs.RESULTS + outputs.LEFTOVERS:
        if name == "config.json":
            checkpoint.record_settings(train.parse_args(["--out", str(tmp_path)]))
        elif (name.endswith((".jsonl", ".tmp")) and "checkpoint" not in name
                and "reference" not in name):
            (tmp_path / name).write_text('{"iteration": 0}\n')
        else:
            (tmp_path / name).mkdir()
            (tmp_path / name / "trainer_state.pt").write_bytes(b"x")
    (tmp_path / "diagnose.jsonl").write_text("{}\n")
    with pytest.raises(DataError, match="holds an earlier run"):
        start.prepare_out(train.parse_args(["--out", str(tmp_path)]))
    before = sorted(os.listdir(tmp_path))
    start.prepare_out(train.parse_args(["--out", str(tmp_path), "--overwrite"]))
    assert sorted(os.listdir(tmp_path)) == before  # nothing removed yet
    start.remove_earlier_run(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == [".lock", "diagnose.jsonl"]
    assert (checkpoint.find_resume(train.parse_args(["--out", str(tmp_path), "--resume"]))
            == (None, None))
    start.held_lock.close()


# ---- interrupts and failed writes end in one line -------------------------------------------


def stopped_run(out, signum):
    """train.py sent `signum` once its first checkpoint is written (after iteration 1; one every
    iteration)."""
    proc = subprocess.Popen([sys.executable, os.path.join(HERE, "train.py"), "--out", str(out),
                             *SMALL, "--iterations", "3"], cwd=HERE, env=OFFLINE,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if (out / "checkpoint").exists():
            break
        time.sleep(0.02)
    proc.send_signal(signum)
    return proc


@pytest.mark.slow
def test_ctrl_c_sigterm_and_a_full_disk_end_in_one_line_naming_the_checkpoint(tmp_path):
    # the second trainer state meets a full disk
    script = ("import runpy, sys, torch\nsaved = torch.save\n"
              "def save(obj, path, *a, n=[0]):\n    n[0] += 1\n"
              "    if n[0] == 2: raise OSError(28, 'No space left on device')\n"
              "    saved(obj, path, *a)\n"
              "torch.save = save\nsys.argv = sys.argv[1:]\n"
              "runpy.run_path(sys.argv[0], run_name='__main__')\n")
    full = subprocess.Popen([sys.executable, "-c", script, os.path.join(HERE, "train.py"), "--out",
                             str(tmp_path / "full"), *SMALL], cwd=HERE, env=OFFLINE,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    runs = {"SIGINT": stopped_run(tmp_path / "int", signal.SIGINT),
            "SIGTERM": stopped_run(tmp_path / "term", signal.SIGTERM)}
    for name, proc in runs.items():
        err = proc.communicate(timeout=300)[1]
        assert proc.returncode == 128 + signal.Signals[name] and "Traceback" not in err, err[-3000:]
        out = tmp_path / ("int" if name == "SIGINT" else "term")
        assert err.splitlines()[-1] in (
            f"stopped by {name}; the last checkpoint is {out / 'checkpoint'}: --resume (in place "
            "of any --overwrite) continues from it", f"stopped by {name}; the last checkpoint is "
            f"{out / 'checkpoint.old'}: --resume (in place of any --overwrite) continues from it")
    err = full.communicate(timeout=300)[1]
    assert full.returncode == 1 and "Traceback" not in err, err[-3000:]
    full_out = tmp_path / "full"
    assert err.splitlines()[-1] == (f"error: cannot write {full_out / 'checkpoint.tmp'} "
                                    "([Errno 28] No space left on device); the last checkpoint is "
                                    f"{full_out / 'checkpoint'}: "
                                    "--resume (in place of any --overwrite) continues from it")
    assert complete_iteration(tmp_path / "full" / "checkpoint") == 1
    resumed = run_train("--out", str(tmp_path / "term"), *SMALL, "--iterations", "3", "--resume")
    assert (resumed.returncode == 0
            and [row["iteration"] for row in numbers(tmp_path / "term")] == [0, 1, 2, 3])


# ---- what --resume reads, checked by shape --------------------------------------------------


def test_metrics_rows_torn_last_line_dropped_any_other_bad_line_refused(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"iteration": 0}\n{"iteration": 1, "x": 2}\n{"iteration": 2}\n'
                    '{"iteration": 3, "tr')
    assert (checkpoint.rows_up_to(str(path), 1)
            == ['{"iteration": 0}\n', '{"iteration": 1, "x": 2}\n'])
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
    ('{"model": "tiny"}', "is not a run's settings (train.py's --iterations, --algo, --out)"),
])
def test_resume_checks_the_runs_settings_file(tmp_path, settings, message):
    """OUT/config.json is what --resume compares a continued run with: missing or damaged, one
    line."""
    (tmp_path / "checkpoint").mkdir()
    torch.save({"iteration": 1, "optimizers": [], "rng": []},
               tmp_path / "checkpoint" / "trainer_state.pt")
    if settings is not None:
        (tmp_path / "config.json").write_text(settings)
    resume = train.parse_args(["--out", str(tmp_path), "--resume", "--iterations", "3"])
    with pytest.raises(DataError, match=r"^--resume: .*config.json " + re.escape(message)):
        checkpoint.find_resume(resume)
    checkpoint.record_settings(train.parse_args(["--out", str(tmp_path), "--iterations", "2",
                                                 "--seed", "1"]))
    with pytest.raises(DataError, match=rf"^--resume: {tmp_path} was written with --seed 1, not 0; "
                                        r"each iteration's problems are drawn with --seed \+ "
                                        "iteration$"):
        checkpoint.find_resume(resume)
    # every setting, not only those changed
    written = json.loads((tmp_path / "config.json").read_text())
    assert set(written) == set(vars(train.Config())) | {"data_files"}
    # arith: no file
    assert (written["iterations"], written["seed"], written["data_files"]) == (2, 1, {})


def test_a_damaged_checkpoint_is_named_as_the_runs_not_as_model(tmp_path, tiny):
    save(tmp_path, tiny, 1)
    weights = tmp_path / "checkpoint" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # truncated
    for path in (tmp_path / "checkpoint", tmp_path / "reference"):
        with pytest.raises(DataError,
                           match=rf"^--resume: {path} cannot be loaded \(.+\); --overwrite starts"):
            models.load_model(str(path), "cpu", resuming=True)
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
    # the limits pass
    train.parse_args(["--seed", str(2**63 - 1), "--clip", "1e30", "--eval-temperature", "0"])


def test_sft_examples_capped_at_what_rl_holds_with_a_count(tiny, capsys):
    tok, _ = tiny
    problems = [{"prompt": "What is 1+1?\n", "answer": "1+1=2\n#### 2"},
                # a 12 KB answer
                {"prompt": "What is 2+2?\n", "answer": "2+2=4\n" * 2000 + "#### 4"}]
    for p in problems:
        p["prompt_ids"] = prompts.encode_prompt(tok, p["prompt"])
    examples = sft.sft_examples(tok, problems, max_tokens=1576)
    (ids, _), = examples
    assert examples == sft.sft_examples(tok, problems[:1], 1576) and len(ids) <= 1576
    assert ("sft: skipped 1 of 2 training problems: prompt and solution over --max-prompt-tokens + "
            "--max-new-tokens = 1576 tokens") in capsys.readouterr().out
    with pytest.raises(DataError,
                       match=r"--max-new-tokens = 20: every training problem's SFT example"):
        sft.sft_examples(tok, problems, max_tokens=20)


def test_sft_skips_a_non_finite_step_as_rl_does(tmp_path, capsys):
    """A NaN loss at the first SFT step: that step is skipped and counted, the weights stay finite,
    and the other steps train them."""
    models.build_tiny_model(str(tmp_path), seed=0)
    tok, model = models.load_model(str(tmp_path), "cpu")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    calls = []

    def nan_first(module, args, kwargs, output):
        calls.append(1)
        if len(calls) == 1:
            output.loss = output.loss * float("nan")
        return output
    model.register_forward_hook(nan_first, with_kwargs=True)
    cfg = train.parse_args(["--sft-steps", "3", "--sft-batch", "4"])
    problems = [{"prompt": f"What is {i}+1?\n", "answer": f"{i}+1={i + 1}\n#### {i + 1}"}
                for i in range(8)]
    for p in problems:
        p["prompt_ids"] = prompts.encode_prompt(tok, p["prompt"])
    cpu = torch.device("cpu")
    sft.sft_warm_start(model, tok, problems, cfg, cpu, models.autocast(cpu, "fp32"))
    assert ("warning: sft: 1 of 3 steps skipped: non-finite loss or gradient"
            in capsys.readouterr().out)
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


@pytest.mark.slow
def test_an_unreachable_hub_fails_fast_in_one_line(tmp_path):
    """The hub libraries retry an unreachable hub for ~25 s a file, printing each retry: one quick
    look instead, then one line. The hub is made unreachable (a closed local port) whatever the
    network."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))}
    env.update(HF_ENDPOINT="http://127.0.0.1:9", HF_HOME=str(tmp_path / "hf"))
    train_py = os.path.join(HERE, "train.py")
    runs = [subprocess.Popen([sys.executable, train_py, "--out", str(tmp_path / name), *args],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for name, args in (("model", ["--model", "some-org/some-model"]),
                               ("data", ["--data", "gsm8k"]),
                               ("math", ["--data", "math"]))]
    for proc, message in zip(runs, ("error: --model 'some-org/some-model': cannot load it",
                                    "error: --data gsm8k: cannot load openai/gsm8k from the hub",
                                    "error: --data math: cannot load "
                                    "zzy1123/MATH_train_test_split")):
        out, err = proc.communicate(timeout=120)
        assert (proc.returncode == 2 and err.startswith(message)
                and err.count("\n") == 1), err[-3000:]
        assert "cannot be reached" in out


# ---- a refused start changes nothing; --overwrite removes only what can no longer fail --------


def files(path) -> dict:
    """Every file under path (bar the lock) and its bytes."""
    return {os.path.relpath(os.path.join(folder, name), path):
            open(os.path.join(folder, name), "rb").read()
            for folder, _, names in os.walk(path) for name in names if name != ".lock"}


def start_in_process(*args):
    """start.start_run of train.py's command line, on the CPU in fp32; the lock released after."""
    cfg = train.parse_args(list(args))
    cfg.precision, cpu = "fp32", torch.device("cpu")
    try:
        return start.start_run(cfg, cpu, models.autocast(cpu, "fp32"))
    finally:
        if start.held_lock is not None:
            start.held_lock.close()


def earlier_run(out, tiny, iterations=1, *args):
    """A run's files as train.py leaves them (its settings: those of `args`), checkpoint at
    iteration 1."""
    checkpoint.save_checkpoint(str(out), tiny[1], tiny[0],
                               {"iteration": 1, "optimizers": [], "rng": []})
    checkpoint.save_checkpoint(str(out), tiny[1], tiny[0], name="reference")
    (out / "metrics.jsonl").write_text('{"iteration": 0}\n{"iteration": 1}\n')
    checkpoint.record_settings(train.parse_args(["--out", str(out), "--iterations",
                                                 str(iterations), *args]))


def test_an_out_that_is_in_or_holds_the_model_where_the_run_writes_is_refused(tmp_path, tiny):
    """Issue cases: --out equal to --model wrote its config.json over the model's; --overwrite into
    the run whose checkpoint is --model deleted it. Refused in one line, nothing written; beside it
    is fine."""
    tok, model = tiny
    model.save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    earlier_run(tmp_path / "run", tiny)
    before = files(tmp_path)
    for out, model_dir, where in ((tmp_path / "model", tmp_path / "model", "is"),
                                  (tmp_path / "model" / "rl", tmp_path / "model", "is inside"),
                                  (tmp_path / "run", tmp_path / "run" / "checkpoint",
                                   "holds it as the run's own")):
        with pytest.raises(DataError, match=f"^--out '{out}' {where} --model '{model_dir}': "
                                            "the run would write"):
            start_in_process("--out", str(out), "--model", str(model_dir), "--overwrite")
        assert files(tmp_path) == before and not (tmp_path / "model" / "rl").exists()
    for out, model_dir in ((tmp_path / "other", tmp_path / "run" / "checkpoint"),
                           (tmp_path, tmp_path / "model")):
        start.check_out_apart_from_model(
            train.parse_args(["--out", str(out), "--model", str(model_dir)]))


@pytest.mark.parametrize("bad", [["--max-prompt-tokens", "1"], ["--data", "bad.jsonl"],
                                 ["--eval-data", "x.txt"]])
def test_overwrite_that_is_refused_leaves_the_earlier_run(tmp_path, tiny, bad):
    """--overwrite with a setting that then fails deleted the earlier run first: now the run is
    refused with everything of the earlier one where it was, byte for byte (no tiny-init.tmp left
    either)."""
    (tmp_path / "bad.jsonl").write_text("{\n")
    out = tmp_path / "out"
    earlier_run(out, tiny)
    (out / "tiny-init").mkdir()
    (out / "tiny-init" / "config.json").write_text("{}")
    before = files(out)
    bad = [str(tmp_path / b) if b.endswith("jsonl") else b for b in bad]
    with pytest.raises(DataError):
        start_in_process("--out", str(out), "--overwrite", "--sft-steps", "0", *bad)
    assert files(out) == before and sorted(os.listdir(out)) == [".lock", "checkpoint",
                                                                "config.json", "metrics.jsonl",
                                                                "reference", "tiny-init"]


def test_a_resume_refused_for_a_damaged_row_leaves_config_json(tmp_path, tiny):
    """A --resume refused because of a damaged metrics.jsonl line had already rewritten
    config.json."""
    earlier_run(tmp_path, tiny)
    (tmp_path / "metrics.jsonl").write_text('{"iteration": 0}\nnot a row\n{"iteration": 1}\n')
    before = files(tmp_path)
    with pytest.raises(DataError, match=r"metrics.jsonl:2: expected a row of this run"):
        start_in_process("--out", str(tmp_path), "--resume", "--iterations", "3")
    assert files(tmp_path) == before


def test_resume_with_other_evaluation_or_training_problems_is_refused(tmp_path, tiny):
    """A changed --eval-data, or a .jsonl whose content (so its hold-out) changed, mixed two sets in
    one metrics.jsonl: refused in one line."""
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"question": f"q{i}", "answer": f"#### {i}"}) + "\n"
                            for i in range(9)))
    earlier_run(tmp_path / "run", tiny, 1, "--data", str(data))
    resume = lambda *args: checkpoint.find_resume(train.parse_args(["--out", str(tmp_path / "run"),
                                                                    "--resume", "--data", str(data),
                                                                    *args]))
    assert resume()[1]["iteration"] == 1
    other = "; the run would train or evaluate on other problems or prompts than its rows so far$"
    with pytest.raises(DataError, match=r"^--resume: .* was written with --eval-data '', "
                                        r"not '.*other.jsonl'" + other):
        resume("--eval-data", str(tmp_path / "other.jsonl"))
    with pytest.raises(DataError,
                       match=r"^--resume: .* was written with --eval-problems 400, not 5" + other):
        resume("--eval-problems", "5")
    data.write_text(data.read_text() + json.dumps({"question": "new", "answer": "#### 1"}) + "\n")
    with pytest.raises(DataError, match=rf"^--resume: --data {data} has changed since .* was "
                                        r"written; the run"):
        resume()


@pytest.mark.slow
def test_prompts_that_fill_the_context_are_dropped_and_ppo_trains(tmp_path, capsys):
    """Prompts longer than the model's context (512 tokens: characters, for the tiny model) but
    under --max-prompt-tokens: ppo ended in an IndexError, vineppo and grpo sampled empty
    responses."""
    data = tmp_path / "long.jsonl"
    rows = [{"question": f"What is {i}+1?" + (" Think." * 90 if i % 4 else ""),
             "answer": f"#### {i + 1}"}
            for i in range(80)]  # 3 in 4 over the context: every draw of 4 is likely to hold one
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    cfg = train.parse_args(["--out", str(tmp_path / "out"), "--data", str(data), "--algo", "ppo",
                            *SMALL, "--iterations", "1", "--sft-steps", "0", "--eval-every", "0",
                            "--save-every", "0"])
    cfg.precision = "fp32"
    train.main(cfg)
    start.held_lock.close()
    said = capsys.readouterr().out
    assert re.search(r"skipped \d+ of \d+ training problems: prompt over the model's context "
                     r"of 512", said)
    assert [row["iteration"] for row in numbers(tmp_path / "out")] == [0, 1]
    problems = [{"prompt_ids": [0] * n} for n in (510, 511, 512, 600)]
    assert len(prompts.drop_long_prompts(problems, 1512, "training", context=512)) == 2
    assert "skipped 2 of 4 training problems: prompt over the model's context of 512 tokens " \
           "less one for the response" in capsys.readouterr().out
    # the flag's rule
    assert len(prompts.drop_long_prompts(problems, 510, "training", context=512)) == 1


# ---- settings that would do nothing, or something else ----------------------------------------


@pytest.mark.parametrize("args, message", [
    (["--algo", "grpo", "--critic-warmup", "1"],
     "--critic-warmup 1: only ppo and tppo have a critic to warm up"),
    (["--critic-warmup", "2"], "under vineppo the policy would stand still for 2 iterations"),
    (["--algo", "grpo", "--samples-per-prompt", "1"],
     "--samples-per-prompt 1: GRPO's advantage is a reward less"),
    (["--lr", "3e38"],
     "--lr 3e+38: expected >= 0 and at most 1 (AdamW moves each weight by about lr a step)"),
    (["--critic-lr", "2"], "--critic-lr 2.0: expected >= 0 and at most 1"),
    (["--sft-lr", "1e30"], "--sft-lr 1e+30: expected >= 0 and at most 1"),
    (["--precision", "fp16"], "--precision 'fp16': expected one of fp32, bf16"),
    (["--algo", "ppo", "--iterations", "2", "--critic-warmup", "5"],
     "--critic-warmup 5: at least --iterations 2; the policy would never train"),
    (["--kl-coef", "-1e-9"], "--kl-coef -1e-09: expected >= 0"),  # argparse took it for an option
    (["--lr", "-.5"], "--lr -0.5: expected >= 0"),
])
def test_settings_that_would_do_nothing_or_overflow_are_refused(capsys, args, message):
    test_vine.test_bad_setting_gives_one_line_error(capsys, args, message)
    train.parse_args(["--lr", "1", "--algo", "ppo", "--critic-warmup", "1",
                      "--samples-per-prompt", "2"])


@pytest.mark.parametrize("args, ignored", [
    (["--algo", "grpo", "--critic-lr", "1e-3", "--lam", "0.9", "--mc-rollouts", "3"],
     ["--critic-lr 0.001: ignored (only ppo and tppo have a critic and GAE, not grpo)",
      "--lam 0.9: ignored (only ppo and tppo have a critic and GAE, not grpo)",
      "--mc-rollouts 3: ignored (only vineppo has MC values, not grpo)"]),
    (["--value-clip", "0.1", "--lam-critic", "0.9", "--mc-reuse"],
     ["--lam-critic 0.9: ignored (only ppo and tppo have a critic and GAE, not vineppo)",
      "--value-clip 0.1: ignored (only ppo and tppo have a critic and GAE, not vineppo)"]),
    (["--algo", "tppo", "--value-clip", "0.1", "--max-value-states", "3"],
     ["--value-clip 0.1: ignored (the tracking head learns the outcome itself: no GAE targets, "
      "no value clipping)",
      "--max-value-states 3: ignored (only vineppo has MC values, not tppo)"]),
    (["--mc-increment", "2", "--data", "x.jsonl", "--arith-slip", "0.1"],
     ["--mc-increment 2: ignored (adaptive MC values are off: --mc-max-rollouts 0)",
      "--arith-slip 0.1: ignored (the built-in task's, not --data x.jsonl's)"]),
    (["--algo", "ppo", "--value-clip", "0.1", "--lam-critic", "0.9", "--mc-max-rollouts", "8",
      "--mc-increment", "2"],
     ["--mc-max-rollouts 8: ignored (only vineppo has MC values, not ppo)",
      "--mc-increment 2: ignored (only vineppo has MC values, not ppo)"]),
    (["--algo", "grpo"], []),  # the demo preset's --critic-lr and --mc-rollouts are not the user's
])
def test_a_given_setting_the_run_ignores_is_said_once(capsys, args, ignored):
    train.parse_args(args)
    assert capsys.readouterr().err.splitlines() == ["warning: " + line for line in ignored]


def test_evaluating_in_another_prompt_than_training_is_said(capsys):
    """arith's own prompt is the question and a newline, GSM8K's the reference's: one warning when
    --data and --eval-data differ in it, none when --prompt-template or --chat pose both alike."""
    train.parse_args(["--eval-data", "gsm8k"])
    assert capsys.readouterr().err == (
        "warning: --eval-data gsm8k: asked in its own prompt '[MATH_TASK] Problem:\\n{question}"
        "\\n\\nSolution:', not in '{question}\\n', the one --data arith trains in; "
        "--prompt-template poses both in one\n")
    train.parse_args(["--data", "x.jsonl", "--eval-data", "arith"])
    assert "asked in its own prompt '{question}\\n', not in '[MATH" in capsys.readouterr().err
    for alike in (["--prompt-template", "Q: {question}"], ["--chat"], ["--data", "gsm8k"]):
        train.parse_args(["--eval-data", "gsm8k", *alike])
        assert capsys.readouterr().err == ""


def test_the_token_budgets_are_said_to_change_a_seeds_samples(tiny, capsys):
    """Another --max-batch-tokens cuts sampling into other batches, so a seed draws other samples
    from the same distribution (docs/gpu.md measures both budgets on the demo): --help and the
    README say so where they promise that memory settings change no gradient."""
    tok, model = tiny
    drawn = []
    for budget in (10_000, 26):  # 8 rows of 13 tokens in one batch, or in batches of at most 2
        torch.manual_seed(0)
        sampling = rollout.Sampling(1.0, 1.0, 10, eos_id=tok.eos_token_id, pad_id=0,
                                    max_batch_tokens=budget)
        drawn.append(rollout.sample(model, [[1, 5, 6]] * 8, 1, [10] * 8, sampling)[0])
    assert drawn[0] != drawn[1]
    with pytest.raises(SystemExit):
        train.parse_args(["--help"])
    said = " ".join(capsys.readouterr().out.split())
    assert ("another changes a seed's samples" in said
            and "another changes a seed's MC samples" in said)
    readme = " ".join(open(os.path.join(HERE, "README.md"), encoding="utf-8").read().split())
    assert ("`--max-batch-tokens` and `--forward-batch-tokens` change a seed's samples, not their "
            "distribution" in readme)


def test_fsdp_without_torchrun_is_said(capsys):
    start.start_process(train.parse_args(["--fsdp", "--device", "cpu"]))
    assert "warning: --fsdp: ignored (one process, nothing to shard" in capsys.readouterr().out


# ---- messages that name the right thing ---------------------------------------------------------


class Foreign:
    """Something train.py never pickles."""


def test_model_paths_messages_and_a_foreign_trainer_state(tmp_path, tiny, monkeypatch):
    """An empty --model directory, a missing path that cannot be a hub id, a missing one that could
    be (runs/x: both said), and a trainer state holding an object: each one line of its own, without
    torch's advice to load the file unsafely."""
    from huggingface_hub import constants
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty").mkdir()
    for name, message in (("empty", "--model 'empty': a directory without config.json: expected "
                                    r"one written by save_pretrained \(model and tokenizer\)$"),
                          ("runs/x/y", "--model 'runs/x/y': no such directory$"),
                          ("runs/x", r"--model 'runs/x': cannot load it \(no local directory of "
                                     "that name, nor on the hub: ")):
        with pytest.raises(DataError, match="^" + message):
            models.load_model(name, "cpu")
    with pytest.raises(DataError, match="^--checkpoint '/gone': no such directory"):
        models.load_model("/gone", "cpu", flag="--checkpoint")
    checkpoint.save_checkpoint(str(tmp_path), tiny[1], tiny[0],
                               {"iteration": 1, "foreign": Foreign()})
    with pytest.raises(DataError) as refused:
        checkpoint.find_resume(train.parse_args(["--out", str(tmp_path), "--resume"]))
    assert str(refused.value) == (f"--resume: {tmp_path}/checkpoint/trainer_state.pt cannot be "
                                  "read (it holds test_survive.Foreign, not only tensors and "
                                  "plain data; train.py does not write such files)"
                                  ) and "weights_only" not in str(refused.value)


def test_eval_data_and_out_messages_name_their_setting(tmp_path, monkeypatch):
    import datasets

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'openai/gsm8k' on the Hub (LocalEntryNotFound)")
    monkeypatch.setattr(datasets, "load_dataset", offline)
    monkeypatch.setattr(models, "go_offline_without_hub", lambda cfg: None)
    with pytest.raises(DataError, match=r"^--eval-data gsm8k: cannot load openai/gsm8k from the "
                                        r"hub \(Couldn't"):
        start_in_process("--out", str(tmp_path / "out"), "--eval-data", "gsm8k")
    with pytest.raises(DataError, match=r"^--eval-data 'nope': expected 'arith', 'gsm8k', 'math'"):
        start_in_process("--out", str(tmp_path / "out"), "--eval-data", "nope")
    (tmp_path / "file").write_text("mine")
    with pytest.raises(DataError,
                       match=rf"^--out '{tmp_path / 'file'}' is a file, not a directory$"):
        start.prepare_out(train.parse_args(["--out", str(tmp_path / "file")]))
    assert (tmp_path / "file").read_text() == "mine"
    os.symlink(tmp_path / "gone", tmp_path / "dangling")
    with pytest.raises(DataError, match=r"is a symbolic link to .*gone', which does not exist$"):
        start.prepare_out(train.parse_args(["--out", str(tmp_path / "dangling")]))


def test_evaluating_on_training_questions_is_said(tmp_path, capsys):
    """The same .jsonl as --data and --eval-data: one warning with the count."""
    data = os.path.join(HERE, "fixtures", "gsm8k_sample.jsonl")
    start_in_process("--out", str(tmp_path), "--data", data, "--eval-data", data,
                     "--sft-steps", "0", "--eval-problems", "3", "--iterations", "0")
    said = capsys.readouterr()
    assert ("warning: 3 of the 3 held-out questions are training questions too"
            in said.out + said.err)
    start_in_process("--out", str(tmp_path / "apart"), "--data", data, "--sft-steps", "0",
                     "--iterations", "0")  # held out by the hash: no overlap, no warning
    said = capsys.readouterr()
    assert "training questions too" not in said.out + said.err


def test_a_full_disk_while_writing_tiny_init_is_one_line(tmp_path, monkeypatch):
    """The tiny model's weights meet a full disk: safetensors raises its own error, which became a
    traceback; now the OSError train.py turns into its one line, and nothing half-written stays."""
    from safetensors import SafetensorError
    from transformers import modeling_utils

    def full(*args, **kwargs):
        raise SafetensorError("Error while serializing: I/O error: No space left on device "
                              "(os error 28)")
    monkeypatch.setattr(modeling_utils, "safe_save_file", full)
    path = str(tmp_path / "tiny-init.tmp")
    with pytest.raises(OSError, match=rf"^cannot write {path} \(Error while serializing: "
                                      r"I/O error: No space left"):
        start.build_tiny(path, seed=0)
    assert os.listdir(tmp_path) == []


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_while_the_libraries_load_is_one_line(tmp_path, signum):
    """Ctrl-C (or SIGTERM) in the first seconds, while torch is being imported: a KeyboardInterrupt
    traceback (SIGTERM: nothing at all) before; one line and 128 + the signal's number now."""
    proc = subprocess.Popen([sys.executable, os.path.join(HERE, "train.py"), "--out",
                             str(tmp_path)], cwd=HERE, env=OFFLINE, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while time.time() < deadline and "torch" not in open(f"/proc/{proc.pid}/maps").read():
        time.sleep(0.005)  # torch's libraries are being loaded: train.py's first lines have run
    proc.send_signal(signum)
    err = proc.communicate(timeout=120)[1]
    name = signal.Signals(signum).name
    assert (proc.returncode == 128 + signum
            and err == f"stopped by {name} while starting; nothing was written\n")
    assert os.listdir(tmp_path) == []


# ---- the tools: one line and exit status 2, as train.py -----------------------------------------


@pytest.mark.parametrize("args, message", [
    (["--k", "a"], "argument --k: 'a': expected an integer >= 1"),
    (["--k", "1,0"], "argument --k: '0': expected an integer >= 1"),
    (["--gt-rollouts", "0"], "argument --gt-rollouts: '0': expected an integer >= 1"),
    (["--arith-steps", "9-3"], "argument --arith-steps: '9-3': expected MIN-MAX, 1 <= MIN <= MAX"),
    (["--arith-steps", "2-9"], "--arith-steps 2-9: at most 8 steps without --arith-traps"),
    (["--temperature", "0"], "argument --temperature: '0': expected >= 0.001"),
    (["--seed", "-1"], "argument --seed: '-1': expected an integer >= 0"),
])
def test_diagnose_settings_are_checked(capsys, args, message):
    import diagnose
    with pytest.raises(SystemExit) as stop:
        diagnose.parse_args(["--checkpoint", "x", *args])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err == f"error: {message}\n"


def test_diagnose_paths_and_counts_are_checked(tmp_path):
    import diagnose
    models.build_tiny_model(str(tmp_path / "model"), seed=0)
    (tmp_path / "file").write_text("mine")
    ok = ["--checkpoint", str(tmp_path / "model")]
    for args, message in ((["--checkpoint", "/missing"],
                           "--checkpoint '/missing': no such directory"),
                          ([*ok, "--critic-checkpoint", "/gone"],
                           "--critic-checkpoint '/gone': no such directory"),
                          ([*ok, "--trajectories", "100000"],
                           r"--trajectories 100000: the held-out set has \d+ "),
                          ([*ok, "--out", str(tmp_path / "file")],
                           "--out '.*file' is a file, not a directory")):
        with pytest.raises(DataError, match="^" + message):
            diagnose.main(args)
    assert (tmp_path / "file").read_text() == "mine"


def test_diagnose_values_the_held_out_questions_of_a_file(tmp_path, capsys):
    """diagnose.py --data FILE: the questions train.py holds out of it (10 of the fixture's 55),
    as its help and --trace say, not every row; it says which it used."""
    import diagnose
    (tmp_path / "model").mkdir()
    data = os.path.join(HERE, "fixtures", "gsm8k_sample.jsonl")
    with pytest.raises(DataError, match="^--trajectories 55: the held-out set has 10 problems$"):
        diagnose.main(["--checkpoint", str(tmp_path / "model"), "--data", data,
                       "--trajectories", "55"])
    assert "one question in 5 (10) is held out for evaluation" in capsys.readouterr().out


@pytest.mark.parametrize("args, message", [
    (["--variant", "foo"],
     "--variant 'foo': expected NAME=FLAGS with NAME beginning with one of vineppo, ppo"),
    (["--seconds", "-1"], "--seconds -1.0: expected a number of seconds >= 0"),
    (["--variant", "vineppo=--mc-reuse", "--algos", "vineppo"],
     "--variant 'vineppo=--mc-reuse': expected"),
    (["--seeds", "a"], "--seeds 'a': expected comma-separated integers >= 0"),
    (["--chains", "6"], "--chains '6': expected comma-separated MIN-MAX, 1 <= MIN <= MAX"),
    (["--chains", "9-12", "--traps", ""],
     "--chains '9-12': expected comma-separated MIN-MAX, 1 <= MIN <= MAX, at "
     "most 8 steps without --traps"),
    (["--traps", "2"], "--traps '2': expected '' or MIN-MAX, 0 <= MIN <= MAX"),
    (["--algos", "vineppo,a2c"],
     "--algos 'vineppo,a2c': expected distinct names of vineppo, ppo, tppo, grpo"),
    (["--jobs", "0"], "--jobs 0: expected >= 1"),
    (["--iterations", "-1"], "--iterations -1: expected >= 0"),
])
def test_compare_settings_are_checked(capsys, args, message):
    import compare
    with pytest.raises(SystemExit) as stop:
        compare.parse_args(args)
    err = capsys.readouterr().err
    assert (stop.value.code == 2 and err.startswith(f"error: {message}")
            and err.count("\n") == 1), err


@pytest.mark.slow
def test_compare_stops_with_train_pys_own_line(tmp_path, capfd):
    """A run that fails: train.py's one line, and compare.py ends with its exit status, not a
    CalledProcessError traceback on top."""
    import compare
    (tmp_path / "sft").write_text("a file where the run's directory should be")
    with pytest.raises(SystemExit) as stop:
        compare.run(str(tmp_path / "sft"), "--iterations", "0")
    err = capfd.readouterr().err
    assert (stop.value.code == 2
            and err == f"error: --out '{tmp_path / 'sft'}' is a file, not a directory\n")


@pytest.mark.slow
def test_a_refused_second_run_leaves_the_first_runs_files(tmp_path):
    """A second run into a busy --out is refused and removes nothing of the first's.

    The first run builds OUT/tiny-init.tmp, then trains SFT for ~20 s; the second is refused
    meanwhile; the first then renames tiny-init.tmp and finishes (it died there before)."""
    out = tmp_path / "run"
    args = ["--out", str(out), "--iterations", "0", "--sft-steps", "300", "--sft-batch", "16",
            "--eval-problems", "4", "--eval-samples", "1"]
    first = subprocess.Popen([sys.executable, os.path.join(HERE, "train.py"), *args], env=OFFLINE,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not (out / "tiny-init.tmp" / "config.json").exists() and time.time() < deadline:
        time.sleep(0.2)
    second = run_train(*args)
    assert second.returncode == 2 and "is in use by a run that is still going" in second.stderr
    assert first.poll() is None, "the first run ended before the second was refused"
    assert (out / "tiny-init.tmp").is_dir()  # the first run's, untouched
    assert first.wait(timeout=600) == 0, first.stderr.read()[-2000:]
    assert (out / "tiny-init").is_dir() and (out / "checkpoint").is_dir()


# ---- issue 36: what --resume cannot recover or change, and model folders that are not models ----


def test_resume_warns_of_a_metrics_row_up_to_the_checkpoint_that_is_gone(tmp_path, capsys):
    """The checkpoint is at iteration 2, its metrics row was torn: one warning line names it.

    The run goes on (the row cannot be made again); a torn row after the checkpoint, which the
    resumed run writes again, is not warned of."""
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"iteration": 0}\n{"iteration": 1}\n{"iteration": 2, "tr')
    rows = checkpoint.rows_to_keep(str(tmp_path), {"iteration": 2})
    assert rows == {str(path): ['{"iteration": 0}\n', '{"iteration": 1}\n']}
    warning = (f"warning: --resume: {path} has no row for iteration 2 (torn or lost when the run "
               "stopped); it cannot be recovered, the run goes on without it\n")
    assert capsys.readouterr().out == warning
    checkpoint.rows_to_keep(str(tmp_path), {"iteration": 1})
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("flag, value, written", [
    ("--lr", "2e-05", "0.0001"), ("--critic-lr", "2e-05", "0.0001"), ("--warmup", "0.5", "0.0")])
def test_resume_with_another_rate_or_warmup_is_refused(tmp_path, tiny, flag, value, written):
    """A changed rate is refused, naming the rate the restored optimizers and schedules keep.

    It used to go on with the old rate while config.json recorded the new one."""
    earlier_run(tmp_path, tiny, 1, "--algo", "ppo")
    args = ["--out", str(tmp_path), "--resume", "--algo", "ppo"]
    assert checkpoint.find_resume(train.parse_args([*args, flag, written]))[1]["iteration"] == 1
    with pytest.raises(DataError) as refused:
        checkpoint.find_resume(train.parse_args([*args, flag, value]))
    assert str(refused.value) == (f"--resume: {tmp_path} was written with {flag} {written}, "
                                  f"not {value}; its optimizers and LR schedules were built "
                                  f"with {written}")


def test_a_folder_without_a_tokenizer_or_a_gguf_directory_is_said_so(tmp_path, tiny, monkeypatch):
    """A model without its tokenizer files, or a run's folder for its checkpoint/, named the backend
    tokenizer; a directory named x.gguf was 'no such file'."""
    import diagnose
    monkeypatch.chdir(tmp_path)
    tiny[1].save_pretrained(tmp_path / "weights")  # no tokenizer files
    missing = r"\(missing: tokenizer.json, tokenizer_config.json\)"
    with pytest.raises(DataError, match=rf"^--checkpoint 'weights': no tokenizer in it {missing}; "
                                        "a run's checkpoint/ holds them"):
        models.load_model("weights", "cpu", flag="--checkpoint")
    with pytest.raises(DataError, match=r"^--resume: weights cannot be loaded \(no tokenizer"):
        models.load_model("weights", "cpu", resuming=True)
    earlier_run(tmp_path / "run", tiny)
    with pytest.raises(DataError) as refused:
        diagnose.main(["--checkpoint", "run"])
    assert str(refused.value) == ("--checkpoint 'run': a run's folder, not a model (missing: "
                                  "tokenizer.json, tokenizer_config.json); its checkpoint/ holds "
                                  "them, with the weights: give run/checkpoint")
    (tmp_path / "x.gguf").mkdir()
    with pytest.raises(DataError, match=r"^--model 'x.gguf': a directory, not a .gguf file$"):
        models.load_model("x.gguf", "cpu")


def no_runs(monkeypatch):
    """compare.py as a test sees it: any run or subprocess it starts fails the test."""
    import compare

    def started(*args, **kwargs):
        raise AssertionError(f"a run started: {args}")
    monkeypatch.setattr(compare, "run", started)
    monkeypatch.setattr(compare.subprocess, "Popen", started)
    return compare


@pytest.mark.parametrize("variants, message", [
    (["grpo-o=--out runs/victim"], "--out: compare.py's own"),
    (["grpo-s=--seed 5"], "--seed: compare.py's own"),
    (["grpo-s=--se=5"], "--seed: compare.py's own"),  # argparse's abbreviation of --seed
    (["grpo-y=--algo vineppo"], "--algo: compare.py's own"),
    (["grpo-w=--lr 1e-4 --overwrite"], "--overwrite: compare.py's own"),
    (["grpo-r=--resume"], "--resume: compare.py's own"),
    (["grpo-/../../../esc=--lr 1e-4"], "NAME 'grpo-/../../../esc' names the runs' folders"),
    (["grpo-x=--chat --system 'two"], "FLAGS, split as a shell does: No closing quotation"),
    (["grpo-x=--foo 1"], "unrecognized arguments: --foo 1"),
    (["grpo-x=--lr abc"], "argument --lr: invalid float value: 'abc'"),
    (["grpo-x=--samples-per-prompt 1"], "--samples-per-prompt 1: GRPO's advantage"),
    (["grpo-a=--lr 1", "grpo-a=--lr 0"], "expected a NAME of its own, 'grpo-a' is a duplicate"),
])
def test_compare_variants_are_checked_before_any_run(monkeypatch, capsys, tmp_path, variants,
                                                      message):
    """A bad --variant is refused in one line before the SFT start, or any run, begins."""
    compare = no_runs(monkeypatch)
    argv = ["--out", str(tmp_path), "--chains", "6-8", "--seeds", "0,1", "--jobs", "1"]
    monkeypatch.setattr(sys, "argv", ["compare.py", *argv,
                                      *[x for v in variants for x in ("--variant", v)]])
    with pytest.raises(SystemExit) as stop:
        compare.main()
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"error: --variant {variants[-1]!r}: {message}"), err
    assert os.listdir(tmp_path) == []


def test_compare_seeds_are_distinct(monkeypatch, capsys):
    """--seeds 0,0 would count one run twice, as two seeds that agree: refused in one line."""
    compare = no_runs(monkeypatch)
    monkeypatch.setattr(sys, "argv", ["compare.py", "--seeds", "0,0", "--jobs", "1"])
    with pytest.raises(SystemExit) as stop:
        compare.main()
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err == "error: --seeds '0,0': a seed given twice; " \
                                           "expected distinct seeds\n", err


def test_compare_variant_runs_get_their_own_out_seed_and_algo(monkeypatch, capsys, tmp_path):
    """A variant's flags reach train.py split as a shell splits them.
    Every run's --out, --seed and --algo are compare.py's: its folder, its seed, NAME's algorithm.
    """
    import compare
    calls = []
    monkeypatch.setattr(compare, "run", lambda out, *args, seconds=0.0: calls.append((out, args)))

    class Done(Exception):
        pass

    def curve(out, metric):
        raise Done
    monkeypatch.setattr(compare, "curve", curve)  # every run is started: stop before the report
    flags = "--lr \"1e-4\" --chat --system 'two words'"
    monkeypatch.setattr(sys, "argv", ["compare.py", "--out", str(tmp_path), "--chains", "6-8",
                                      "--seeds", "0,1", "--algos", "vineppo", "--jobs", "1",
                                      "--variant", f"grpo-q={flags}"])
    with pytest.raises(Done):
        compare.main()
    outs = [os.path.relpath(out, tmp_path) for out, _ in calls]
    assert outs == ["chains6-8/sft", "chains6-8/vineppo-seed0", "chains6-8/grpo-q-seed0",
                    "chains6-8/vineppo-seed1", "chains6-8/grpo-q-seed1"], outs
    for out, args in calls[1:]:  # the command line run() gives train.py
        cfg = train.parse_args(["--out", out, "--overwrite", *args])
        name, seed = os.path.basename(out).rsplit("-seed", 1)
        assert (cfg.out, cfg.seed, cfg.algo) == (out, int(seed), name.split("-")[0])
        if name == "grpo-q":
            assert (cfg.lr, cfg.chat, cfg.system) == (1e-4, True, "two words")
    capsys.readouterr()


def test_compare_marks_finished_only_a_run_that_was_written(monkeypatch, capsys, tmp_path):
    """A train.py that exits 0 without its run folder: one line and exit 1.
    Not a FileNotFoundError traceback for the `finished` mark.
    """
    import compare

    class Ended:
        returncode = 0

        def __init__(self, *args, **kwargs):
            pass

        def poll(self):
            return 0
    monkeypatch.setattr(compare.subprocess, "Popen", Ended)
    out = str(tmp_path / "never-written")
    with pytest.raises(SystemExit) as stop:
        compare.run(out, "--iterations", "0")
    err = capsys.readouterr().err
    assert stop.value.code == 1 and err == f"error: train.py ended without writing its run " \
                                           f"to {out!r}\n", err
    assert not os.path.exists(out)


# ---- issue 52: folders that are not a run's, outputs kept, reuse and resume that say what runs --


def test_an_out_holding_files_that_are_not_a_runs_is_refused_naming_one(tmp_path, tiny):
    """Case 1: a copy of a model as --out had its config.json replaced by the run's, and
    --overwrite replaced a user's own config.json. Now refused in one line naming a file that is
    not this project's, with or without --overwrite, nothing written there (no lock either); a
    run's folder holding other tools' files (diagnose.py's, compare.py's mark) is fine."""
    tok, model = tiny
    victim, mine, notes = tmp_path / "victim", tmp_path / "mine", tmp_path / "notes"
    model.save_pretrained(victim)  # cp -a MODEL victim
    tok.save_pretrained(victim)
    mine.mkdir()
    (mine / "config.json").write_text('{"iterations": 3, "lr": 0.1}\n')
    notes.mkdir()
    (notes / "notes.txt").write_text("mine")
    before = files(tmp_path)
    for out, name, what in ((victim, "config.json", "is not a run's settings"),
                            (mine, "config.json", "is not a run's settings"),
                            (notes, "notes.txt", "no tool of this project writes")):
        for flags in ([], ["--overwrite"], ["--resume"]):
            with pytest.raises(DataError, match=f"^--out '{out}' holds '{name}', which {what}"):
                start.prepare_out(train.parse_args(["--out", str(out), *flags]))
    assert files(tmp_path) == before
    assert not any((folder / ".lock").exists() for folder in (victim, mine, notes))
    run = tmp_path / "run"
    earlier_run(run, tiny)
    for name in ("diagnose.jsonl", "trace.json", outputs.FINISHED, "checkpoint.tmp"):
        (run / name).write_text("{}")
    start.prepare_out(train.parse_args(["--out", str(run), "--resume"]))
    start.held_lock.close()


def test_gpu_report_keeps_an_earlier_report_unless_overwrite(tmp_path, capsys):
    """Case 2: bench.py --gpu-report replaced an earlier gpu-report.md and .json (a real GPU's)
    without a word. Now refused in one line unless --overwrite, as train.py's --out is; a folder
    of someone else's files is refused whatever the flags."""
    import bench
    report = tmp_path / "report"
    report.mkdir()
    (report / "gpu-report.md").write_text("a real GPU's report")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    for args, message in (
            ([str(report), "--smoke"],
             f"--gpu-report '{report}' holds an earlier report (gpu-report.md): pass "
             "--overwrite to replace it"),
            ([str(tmp_path / "other"), "--smoke", "--overwrite"],
             f"--gpu-report '{tmp_path / 'other'}' holds 'notes.txt', which no tool of this "
             "project writes: nothing is written there; choose an empty folder, or one of this "
             "project's")):
        with pytest.raises(SystemExit) as stop:
            bench.parse_args(["--gpu-report", *args])
        assert stop.value.code == 2 and capsys.readouterr().err == f"error: {message}\n"
    bench.parse_args(["--gpu-report", str(report), "--smoke", "--overwrite"])
    bench.parse_args(["--gpu-report", str(tmp_path / "new"), "--smoke"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--overwrite"])
    assert capsys.readouterr().err == "error: --overwrite: only with --gpu-report OUT\n"
    assert (report / "gpu-report.md").read_text() == "a real GPU's report"


@pytest.mark.parametrize("train_args, owned", [
    ("--lr 1e-4 --out RUN --overwrite", "--out, --overwrite"),
    ("--lr 1e-4 --ou=RUN", "--out"),  # argparse's abbreviation
    ("--resume --algo ppo", "--algo, --resume")])
def test_bench_train_args_may_not_give_what_bench_gives(capsys, train_args, owned):
    """Case 3: --train-args '... --out RUN --overwrite' trained into another run and replaced it.
    Refused as compare.py --variant refuses them (settings.given_flags, shared)."""
    import bench
    with pytest.raises(SystemExit) as stop:
        bench.parse_args(["--only", "memory", "--train-args", train_args])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err == (f"error: --train-args {train_args!r}: {owned}: "
                                            "bench.py's own; it gives each run of the memory "
                                            "measurement its --algo and a temporary --out\n"), err


def finished_run(compare, out: str, flags: list[str], seconds: float = 0.0):
    """What compare.run leaves of a finished run: its config.json (as train.py records it) and the
    mark."""
    os.makedirs(out)
    cfg = train.parse_args(compare.train_argv(out, *flags))
    cfg.precision = models.default_precision(torch.device("cuda" if torch.cuda.is_available()
                                                          else "cpu"))
    checkpoint.record_settings(cfg)
    with open(os.path.join(out, "finished"), "w") as f:
        json.dump({"seconds": seconds}, f)


def test_compare_reuses_a_finished_run_only_with_the_same_settings(monkeypatch, capsys, tmp_path):
    """Case 4: compare.py reused finished runs made with another --iterations or --slip, and
    reported them under the new settings. Now a run is reused only when its config.json is what
    would run; otherwise one line naming the setting, before any run, or --overwrite reruns it."""
    import compare
    argv = ["--out", str(tmp_path), "--chains", "6-8", "--seeds", "0", "--algos", "grpo",
            "--jobs", "1", "--iterations", "3"]
    args = compare.parse_args(argv)[0]
    sft = os.path.join(str(tmp_path), "chains6-8", "sft")
    rl = os.path.join(str(tmp_path), "chains6-8", "grpo-seed0")
    finished_run(compare, sft, ["--iterations", "0",
                                *compare.as_flags(compare.task_settings(args, "6-8"))])
    finished_run(compare, rl, compare.rl_flags(args, "6-8", 0, ["--algo", "grpo"]))
    started = []

    class Run:  # a train.py that ends well at once
        returncode = 0

        def __init__(self, command, **kwargs):
            started.append(command[command.index("--out") + 1])

        def poll(self):
            return 0

    class Reported(Exception):
        pass

    def curve(out, metric):
        raise Reported
    monkeypatch.setattr(compare.subprocess, "Popen", Run)
    monkeypatch.setattr(compare, "curve", curve)
    capsys.readouterr()
    for more, message in ((["--iterations", "2"], f"{rl} holds a finished run of other settings "
                                                  "(--iterations 3, not 2)"),
                          (["--slip", "0.5"], f"{sft} holds a finished run of other settings "
                                              "(--arith-slip 0.7, not 0.5)")):
        monkeypatch.setattr(sys, "argv", ["compare.py", *argv, *more])
        with pytest.raises(SystemExit) as stop:
            compare.main()
        err = capsys.readouterr().err
        assert stop.value.code == 2 and err == (f"error: {message}: pass --overwrite to run it "
                                                "again, or choose another --out\n"), err
    monkeypatch.setattr(sys, "argv", ["compare.py", *argv])
    with pytest.raises(Reported):  # the same settings: both reused
        compare.main()
    assert started == []
    monkeypatch.setattr(sys, "argv", ["compare.py", *argv, "--iterations", "2", "--overwrite"])
    with pytest.raises(Reported):
        compare.main()
    assert started == [rl]
    assert json.load(open(os.path.join(rl, "finished"))) == {"seconds": 0.0}
    capsys.readouterr()


def test_diagnose_keeps_its_earlier_results_unless_overwrite(tmp_path, tiny, monkeypatch):
    """Case 5: diagnose.py replaced its earlier diagnose.jsonl without a word. Now the rule of
    train.py's --out: refused in one line unless --overwrite, and a folder of someone else's files
    is refused; by default the checkpoint's run folder takes them."""
    import diagnose
    monkeypatch.setattr(diagnose, "value_accuracy",
                        lambda a, tok, policy, sampling, problems, out:
                        open(os.path.join(out, "diagnose.jsonl"), "w").write("new\n"))
    run = tmp_path / "run"
    earlier_run(run, tiny)
    (run / "diagnose.jsonl").write_text("earlier\n")
    (tmp_path / "notes.txt").write_text("mine")
    args = ["--checkpoint", str(run / "checkpoint"), "--trajectories", "1"]
    with pytest.raises(DataError) as refused:
        diagnose.main(args)
    assert str(refused.value) == (f"--out '{run}' holds an earlier diagnose.py's results "
                                  "(diagnose.jsonl): pass --overwrite to replace it")
    with pytest.raises(DataError, match=f"^--out '{tmp_path}' holds 'notes.txt', which no tool"):
        diagnose.main([*args, "--out", str(tmp_path), "--overwrite"])
    assert (run / "diagnose.jsonl").read_text() == "earlier\n"
    diagnose.main([*args, "--overwrite"])
    assert (run / "diagnose.jsonl").read_text() == "new\n"


def test_resume_records_a_changed_setting_from_the_iteration_it_takes_effect(tmp_path, tiny,
                                                                            capsys):
    """Case 10: a changed --mc-rollouts, --max-new-tokens, --temperature or --kl-coef was taken
    without a word and config.json rewritten as if the whole run had used it. Now said at start
    and kept as history; a value recorded after the checkpoint (a resume killed before its next
    one) is dropped, as its rows are."""
    earlier_run(tmp_path, tiny)  # the demo's: K 4, T 0.6, beta 0.001, 64 tokens; checkpoint at 1
    tok = tiny[0]
    changed = ["--mc-rollouts", "8", "--temperature", "0.7", "--kl-coef", "0.01",
               "--max-new-tokens", "32"]
    cfg = train.parse_args(["--out", str(tmp_path), "--resume", "--iterations", "3", *changed])
    state = checkpoint.find_resume(cfg)[1]
    capsys.readouterr()
    start.begin_writing(cfg, state, {}, None, tok)
    assert capsys.readouterr().out.splitlines()[-1] == (
        "--resume: from iteration 2 on, --mc-rollouts 8 (4 before), --kl-coef 0.01 (0.001 "
        "before), --temperature 0.7 (0.6 before), --max-new-tokens 32 (64 before); "
        f"{tmp_path}/config.json keeps each one's history")
    written = json.loads((tmp_path / "config.json").read_text())
    assert (written["mc_rollouts"], written["history"]["mc_rollouts"]) == (
        8, [{"from_iteration": 0, "value": 4}, {"from_iteration": 2, "value": 8}])
    assert set(written["history"]) == {"mc_rollouts", "temperature", "kl_coef", "max_new_tokens"}
    # killed before its next checkpoint, resumed from iteration 1 again with K 4: K's 8 is gone
    again = train.parse_args(["--out", str(tmp_path), "--resume", "--iterations", "3",
                              *changed[2:]])
    start.begin_writing(again, checkpoint.find_resume(again)[1], {}, None, tok)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["mc_rollouts"] == 4 and "mc_rollouts" not in written["history"]
    assert written["history"]["temperature"][-1] == {"from_iteration": 2, "value": 0.7}


@pytest.mark.parametrize("run, flags, message", [
    ([], ["--seed", "1"], "--seed 0, not 1; each iteration's problems are drawn with --seed + "
                          "iteration"),
    ([], ["--algo", "grpo"], "--algo 'vineppo', not 'grpo'; the checkpoint holds that "
                             "method's learners (a critic and its head, or none)"),
    ([], ["--sft-lr", "0.5"], "--sft-lr 0.001, not 0.5; the policy and its KL reference were "
                              "made from it"),
    (["--algo", "ppo"], ["--critic-warmup", "1"], "--critic-warmup 0, not 1; the policy's LR "
                                                  "schedule was built to begin after it"),
    ([], ["--critic-lr", "0.5"], None),  # vineppo has no critic
    (["--sft-steps", "0"], ["--sft-lr", "0.5", "--sft-batch", "3"], None),  # no SFT
    ([], ["--mc-rollouts", "8", "--top-p", "1.0"], None),
])
def test_resume_refuses_a_setting_only_with_why_and_never_one_the_run_does_not_use(
        tmp_path, tiny, run, flags, message):
    """Case 10: --critic-lr was refused for vineppo, which has no critic; a refusal did not say
    why. Each setting a resumed run cannot change is refused with why; one it does not read never
    is."""
    earlier_run(tmp_path, tiny, 1, *run)
    cfg = train.parse_args(["--out", str(tmp_path), "--resume", *run, *flags])
    if message is None:
        assert checkpoint.find_resume(cfg)[1]["iteration"] == 1
        return
    with pytest.raises(DataError) as refused:
        checkpoint.find_resume(cfg)
    assert str(refused.value) == f"--resume: {tmp_path} was written with {message}"


def test_resume_refuses_another_number_of_optimizer_steps_an_iteration(tmp_path, tiny):
    """Case 10: --epochs, --minibatch, --prompts-per-iter and --samples-per-prompt size the LR
    schedules the checkpoint restores. Another number of steps an iteration is refused (once
    --prompts-per-iter fits the data); the same number is allowed."""
    earlier_run(tmp_path, tiny, 1, "--sft-steps", "0")  # 2 epochs x 32 x 8 / 64: 8 steps
    (tmp_path / "tiny-init").mkdir()
    tiny[1].save_pretrained(tmp_path / "tiny-init")
    tiny[0].save_pretrained(tmp_path / "tiny-init")
    resume = ["--out", str(tmp_path), "--resume", "--sft-steps", "0"]
    with pytest.raises(DataError) as refused:
        start_in_process(*resume, "--epochs", "3")
    assert str(refused.value) == (f"--resume: {tmp_path} was written with 8 optimizer steps an "
                                  "iteration, not 12 (--epochs x --prompts-per-iter x "
                                  "--samples-per-prompt / --minibatch, rounded up); its LR "
                                  "schedules count them")
    for same in (["--minibatch", "60"], ["--prompts-per-iter", "16", "--samples-per-prompt", "16"]):
        checkpoint.check_schedule(train.parse_args([*resume, *same]), 8)
