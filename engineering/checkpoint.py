"""Atomic checkpoints, the run's settings (OUT/config.json), and what --resume needs to continue a
run exactly. Needs: models.py (dropout off), parallel.py, value.py (the critic), tasks.py
(DataError). All engineering: a first reading may skip this file."""
import dataclasses
import hashlib
import json
import os
import pickle
import random
import re
import shlex
import shutil

import torch
from tqdm import tqdm

import value
from engineering import outputs, parallel, settings
from engineering.models import without_dropout
from engineering.tasks import DataError, first_line


def record_settings(cfg, resumed_at: int | None = None):
    """Every setting to OUT/config.json (atomically; --resume checks against it), and those that
    differ from the defaults (a preset's included) printed as flags, so that a run says what it
    runs with. A run resumed from the checkpoint at iteration `resumed_at` keeps the history of
    the settings changed since (settings.with_history), and says them."""
    if parallel.rank() != 0:
        return
    values, defaults = dataclasses.asdict(cfg), settings.defaults(cfg)
    quoted = lambda v: ((repr(v) if "\n" in v else shlex.quote(v))  # a template
                        if isinstance(v, str) else v)
    flag = lambda k, v: f"--{k.replace('_', '-')}" + ("" if v is True else f" {quoted(v)}")
    changed = [flag(k, v) for k, v in values.items() if v != defaults[k] and v is not False]
    path = os.path.join(cfg.out, "config.json")
    tqdm.write(f"settings ({path} has all): {' '.join(changed) or 'the defaults'}")
    record = {**values, "data_files": data_files(cfg)}
    if resumed_at is not None:
        record, changes = settings.with_history(run_with(cfg), record, resumed_at + 1,
                                                settings.unused(cfg))
        if changes:
            tqdm.write(f"--resume: from iteration {resumed_at + 1} on, {', '.join(changes)}; "
                       f"{path} keeps each one's history")
    with open(path + ".tmp", "w") as f:
        json.dump(record, f, indent=1)
    os.replace(path + ".tmp", path)


def data_files(cfg) -> dict:
    """The SHA-256 of each .jsonl the run reads (--data, --eval-data): a resumed run must read
    the same."""
    digests = {}
    for name in ("data", "eval_data"):
        path = getattr(cfg, name)
        if path.endswith(".jsonl"):
            with open(path, "rb") as f:
                digests[name] = hashlib.sha256(f.read()).hexdigest()
    return digests


def recorded_settings(out: str) -> dict:
    """The settings OUT/config.json holds, or one line that says why there are none."""
    path = os.path.join(out, "config.json")
    try:
        with open(path) as f:
            settings = json.load(f)
    except (OSError, ValueError) as e:
        raise start_again(f"{path} cannot be read ({first_line(e)})") from None
    if not outputs.is_run_settings(settings):
        raise start_again(f"{path} is not a run's settings (train.py's --iterations, --algo, "
                          "--out)")
    return settings


def start_again(problem: str) -> DataError:
    """What a --resume that cannot continue says: the problem, and the way out."""
    return DataError(f"--resume: {problem}; --overwrite starts the run again")


def save_checkpoint(out: str, policy, tok, state: dict | None = None, critic=None,
                    name: str = "checkpoint", policy_weights: dict | None = None,
                    critic_weights: dict | None = None):
    """Write OUT/name atomically; *_weights: full FSDP state dicts. A kill at any instant, leftovers
    of an earlier one included, leaves name/ complete, or no name/ and a complete name.old/
    (last_checkpoint)."""
    final, tmp, old = (os.path.join(out, name + suffix) for suffix in ("", ".tmp", ".old"))
    try:
        shutil.rmtree(tmp, ignore_errors=True)  # a save that was killed
        write_checkpoint(tmp, policy, tok, state, critic, policy_weights, critic_weights)
    except Exception as e:  # a full disk, no permission: the last checkpoint stays as it was
        shutil.rmtree(tmp, ignore_errors=True)
        raise OSError(f"cannot write {tmp} ({first_line(e)})") from None
    if os.path.exists(final):
        shutil.rmtree(old, ignore_errors=True)  # a leftover: name/ is complete whenever it exists
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


def write_checkpoint(path: str, policy, tok, state, critic, policy_weights, critic_weights):
    policy.save_pretrained(path, state_dict=policy_weights)
    tok.save_pretrained(path)
    if critic is not None:
        critic_weights = critic_weights or critic.state_dict()
        part = lambda prefix: {k[len(prefix):]: v for k, v in critic_weights.items()
                               if k.startswith(prefix)}
        critic.backbone.save_pretrained(os.path.join(path, "critic"), state_dict=part("backbone."))
        torch.save({"head": critic.head_type, "state": part("head.")},
                   os.path.join(path, "critic", "value_head.pt"))
    if state is not None:
        torch.save(state, os.path.join(path, "trainer_state.pt"))


def load_critic(checkpoint: str, device):
    """The critic saved in a checkpoint; None when it has none (VinePPO, GRPO)."""
    path = os.path.join(checkpoint, "critic")
    if not os.path.isdir(path):
        return None
    from transformers import AutoConfig, AutoModel
    try:
        head = load_plain(os.path.join(path, "value_head.pt"))
        backbone = AutoModel.from_pretrained(
            path, config=without_dropout(AutoConfig.from_pretrained(path)))
        critic = value.Critic(backbone, head["head"])
        critic.head.load_state_dict(head["state"])
    except Exception as e:  # a PPO run's checkpoint without its critic cannot continue
        raise start_again(f"{path} cannot be loaded ({first_line(e)})") from None
    return critic.to(device)


def last_checkpoint(out: str) -> str | None:
    """checkpoint/, or checkpoint.old/ when a kill fell between the two renames of a save."""
    for name in ("checkpoint", "checkpoint.old"):
        if os.path.exists(os.path.join(out, name, "trainer_state.pt")):
            return os.path.join(out, name)
    return None


def find_resume(cfg) -> tuple[str | None, dict | None]:
    """--resume: the last complete checkpoint and its state, checked; (None, None) for a fresh
    start."""
    if not cfg.resume:
        return None, None
    path = last_checkpoint(cfg.out)
    if path is None:
        if any(os.path.exists(os.path.join(cfg.out, name))
               for name in ("checkpoint", "checkpoint.old")):
            raise start_again(f"{cfg.out}/checkpoint has no trainer_state.pt to continue from")
        # killed before its first checkpoint: starting over loses only rows a resume would drop too
        tqdm.write(f"--resume: no checkpoint in {cfg.out} yet, starting from scratch")
        return None, None
    try:
        state = load_plain(os.path.join(path, "trainer_state.pt"))
    except Exception as e:  # a damaged file: refuse, never start over on top of the results
        raise DataError(f"--resume: {path}/trainer_state.pt cannot be read "
                        f"({first_line(e)})") from None
    check_shape(state, f"{path}/trainer_state.pt")
    written = recorded_settings(cfg.out)  # the authority on what the run runs with
    refused = settings.refused_on_resume(cfg, written)
    if refused:
        raise DataError(f"--resume: {cfg.out} was {refused}")
    recorded = written.get("data_files")  # None: written before the files were recorded, unchecked
    for key, digest in data_files(cfg).items():
        if isinstance(recorded, dict) and recorded.get(key) != digest:
            raise DataError(f"--resume: --{key.replace('_', '-')} {getattr(cfg, key)} has changed "
                            f"since {cfg.out} was written; the run would train or evaluate on "
                            "other problems")
    if state["iteration"] >= cfg.iterations and parallel.rank() == 0:
        tqdm.write(f"--resume: the checkpoint is at iteration {state['iteration']}, --iterations "
                   f"{cfg.iterations}: nothing to train")
    elif written["iterations"] < cfg.iterations and parallel.rank() == 0:
        tqdm.write(f"--resume: --iterations {cfg.iterations}, not {written['iterations']}: "
                   f"the LR schedule is stretched to end at iteration {cfg.iterations}")
    return path, state


def run_with(cfg) -> dict:
    """The settings the run in --out recorded; one newer than the run takes its default."""
    return {**settings.defaults(cfg), **recorded_settings(cfg.out)}


def check_schedule(cfg, steps: int):
    """--resume: the restored LR schedules count optimizer steps, `steps` an iteration now
    (settings.steps_per_iteration, once --prompts-per-iter fits the data); another number is
    refused."""
    before = settings.steps_per_iteration(run_with(cfg))
    if before != steps:
        raise DataError(f"--resume: {cfg.out} was written with {before} optimizer steps an "
                        f"iteration, not {steps} (--epochs x --prompts-per-iter x "
                        "--samples-per-prompt / --minibatch, rounded up); its LR schedules "
                        "count them")


def load_plain(path: str):
    """torch.load of tensors and plain data only (weights_only): a file holding anything else is
    refused with what it holds, not with torch's advice to load it unsafely."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(e))
        raise ValueError(f"it holds {found.group(1) if found else 'objects'}, not only tensors and "
                         "plain data; train.py does not write such files") from None


def check_shape(state, path: str):
    """A trainer state as save_training_state writes it, or one line that says what is missing."""
    shape = {"iteration": int, "optimizers": list, "rng": list}
    for key, kind in shape.items():
        if not isinstance(state, dict) or not isinstance(state.get(key), kind):
            raise start_again(f"{path} is not a trainer state (no {kind.__name__} {key!r})")


def save_training_state(cfg, iteration: int, tok, policy, critic):
    """Checkpoint weights, optimizers, schedules and random streams; called on every process, one
    writes."""
    learners = [policy] + ([critic] if critic is not None else [])
    optimizers = [{"optimizer": parallel.optimizer_state(learner.model, learner.optimizer),
                   "scheduler": learner.scheduler.state_dict()} for learner in learners]
    policy_weights = parallel.full_state_dict(policy.model)
    critic_weights = parallel.full_state_dict(critic.model) if critic is not None else None
    # CUDA: this process's device only
    # (touching every GPU from every process would open a context on each)
    cuda = [torch.cuda.get_rng_state()] if torch.cuda.is_available() else []
    rngs = parallel.gather({"python": random.getstate(), "torch": torch.get_rng_state(),
                            "cuda": cuda})
    if parallel.rank() == 0:
        # settings: OUT/config.json
        state = {"iteration": iteration, "optimizers": optimizers, "rng": rngs}
        save_checkpoint(cfg.out, policy.model, tok, state, critic and critic.model,
                        policy_weights=policy_weights, critic_weights=critic_weights)


def restore_training_state(cfg, state: dict | None, learners: list) -> int | None:
    """The last iteration done (None: a fresh run); on resume, the optimizers, schedules and random
    streams."""
    if state is None:
        return None
    try:
        restore_states(cfg, state, learners)
    except (KeyError, IndexError, TypeError, ValueError, RuntimeError) as e:
        raise start_again(f"the trainer state in {cfg.out} does not fit this run "
                          f"({first_line(e)})") from None
    return state["iteration"]


def rows_to_keep(out: str, state: dict | None) -> dict:
    """{path: rows} of metrics.jsonl and samples.jsonl as the run goes on from them (write_rows):
    none for a fresh run, the rows up to the checkpoint on resume (read here, before the run writes
    anything)."""
    paths = [os.path.join(out, name) for name in ("metrics.jsonl", "samples.jsonl")]
    if state is None:
        return dict.fromkeys(paths, [])
    rows = {path: rows_up_to(path, state["iteration"]) for path in paths if os.path.exists(path)}
    if paths[0] in rows:
        warn_of_missing_rows(paths[0], rows[paths[0]], state["iteration"])
    return rows


def warn_of_missing_rows(path: str, rows: list[str], last_iteration: int):
    """One warning line naming the iterations up to the checkpoint that have no metrics row.

    A row torn by a kill, or lost with the disk's cache, while the checkpoint after it was kept:
    it cannot be made again, so the run goes on without it, and says so."""
    found = {json.loads(row)["iteration"] for row in rows}
    missing = [str(it) for it in range(last_iteration + 1) if it not in found]
    if missing and parallel.rank() == 0:
        iterations = "iteration" if len(missing) == 1 else "iterations"
        tqdm.write(f"warning: --resume: {path} has no row for {iterations} {', '.join(missing)} "
                   "(torn or lost when the run stopped); it cannot be recovered, the run goes on "
                   "without it")


def write_rows(rows: dict):
    for path, kept in rows.items():
        with open(path + ".tmp", "w") as f:
            f.writelines(kept)
        os.replace(path + ".tmp", path)


def restore_states(cfg, state: dict, learners: list):
    for learner, saved in zip(learners, state["optimizers"], strict=True):
        parallel.load_optimizer_state(learner.model, learner.optimizer, saved["optimizer"])
        learner.scheduler.load_state_dict(saved["scheduler"])
    if len(state["rng"]) == parallel.world_size():  # one random state per process
        rng = state["rng"][parallel.rank()]
        random.setstate(rng["python"])
        torch.set_rng_state(rng["torch"])
        if rng["cuda"]:
            torch.cuda.set_rng_state(rng["cuda"][0])
    else:
        tqdm.write(f"--resume: written by {len(state['rng'])} processes, now "
                   f"{parallel.world_size()}: random streams reseeded")
        torch.manual_seed(cfg.seed + parallel.rank() + 1000 * (state["iteration"] + 1))


def rows_up_to(path: str, last_iteration: int) -> list[str]:
    """The rows up to the checkpoint: a resumed run neither repeats nor skips one. A last line
    without its newline was torn by a kill and is dropped; any other line that is not a row is
    refused, not deleted."""
    with open(path, "rb") as f:
        lines = f.readlines()
    if lines and not lines[-1].endswith(b"\n"):
        lines.pop()
    rows = []
    for number, line in enumerate(lines, 1):
        try:
            row = json.loads(line.decode("utf-8"))
        except ValueError:  # not UTF-8, not JSON
            row = None
        if not isinstance(row, dict) or type(row.get("iteration")) is not int:
            raise DataError(f"--resume: {path}:{number}: expected a row of this run, a JSON object "
                            "with an integer 'iteration'; remove the line, or --overwrite starts "
                            "the run again")
        if row["iteration"] <= last_iteration:
            rows.append(line.decode("utf-8"))
    return rows


def resume_hint(out: str) -> str:
    """Where an interrupted run can continue from, in one sentence."""
    path = last_checkpoint(out)
    if path is None:
        return f"no checkpoint in {out} yet: --resume starts the run again"
    return (f"the last checkpoint is {path}: --resume (in place of any --overwrite) "
            "continues from it")
