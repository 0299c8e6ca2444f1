"""How train.py's settings are declared, shown and checked.

A setting is a Config field made by arg() with a rule: (a test, the words for what it expects);
--help shows the words, parse_args runs the test. Also the settings that cannot go together,
those a run ignores, what a resumed run may change, the flags a command line gives, and the
one-line refusal. Needs no sibling. All engineering: a first reading may skip this file."""
import argparse
import dataclasses
import math
import re
import sys

FLOAT32_MAX = 3.4028234663852886e38


def command_line(config, presets, description: str, add_help: bool = True):
    """An argparse parser with one option per field of the dataclass `config`, each None unless
    given; --help shows each one's help, default and rule (help_text)."""
    p = argparse.ArgumentParser(description=description, add_help=add_help,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.error = refuse  # one line, no usage
    for f in dataclasses.fields(config):
        kind = dict(action="store_true") if f.type is bool else dict(type=f.type)
        p.add_argument("--" + f.name.replace("_", "-"), default=None,
                       help=help_text(f, presets), **kind)
    return p


def arg(default, help, valid=None):
    """A setting: its default, its help, and its rule."""
    return dataclasses.field(default=default, metadata={"help": help, "valid": valid})


def at_least(low):
    return (lambda v: v >= low), f">= {low}"


def above(low):
    return (lambda v: v > low), f"> {low}"


def between(low, high):
    return (lambda v: low <= v <= high), f"between {low} and {high}"


def one_of(*names):  # a name "" is the default, which the help explains
    return (lambda v: v in names), "one of " + ", ".join(name for name in names if name)


def ordered(v: str, low: int) -> bool:
    """v is MIN-MAX with low <= MIN <= MAX."""
    if not re.fullmatch(r"\d+-\d+", v):
        return False
    least, most = map(int, v.split("-"))
    return low <= least <= most


# train.py's rules of a few settings: (a test, the words for what it expects)
DEVICE = (lambda v: re.fullmatch(r"auto|cpu|cuda(:\d+)?", v), "'auto', 'cpu', 'cuda' or 'cuda:N'")
STEPS = (lambda v: ordered(v, 1), "MIN-MAX, 1 <= MIN <= MAX")
TRAPS = (lambda v: v == "" or ordered(v, 0), "'' or MIN-MAX, 0 <= MIN <= MAX")
# AdamW moves every weight by about lr a step (its update is lr times a ratio of moments near +-1):
# above 1 a step outweighs any weight of a language model, and near float32's limit it overflows
LR = (lambda v: 0 <= v <= 1, ">= 0 and at most 1 (AdamW moves each weight by about lr a step)")


NEGATIVE_NUMBER = re.compile(r"-(\d+\.?\d*|\.\d+)(e[-+]?\d+)?|-inf(inity)?|-nan", re.IGNORECASE)


def join_negative_numbers(argv: list[str]) -> list[str]:
    """Each `--flag -1e-9` as `--flag=-1e-9`, so that the rule judges the number.

    argparse takes a negative number it does not recognise (-1e-9, -inf) for an option."""
    joined = []
    for token in argv:
        if NEGATIVE_NUMBER.fullmatch(token) and joined and joined[-1].startswith("--") \
                and "=" not in joined[-1]:
            joined[-1] += "=" + token
        else:
            joined.append(token)
    return joined


def refuse(message: str):
    """A bad command line: one line, exit status 2 (argparse's own error adds its usage)."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def help_text(f: dataclasses.Field, presets) -> str:
    """A setting's help and its default, each preset's first."""
    by_preset = [f"{preset[f.name]} {when}" for preset, when in presets if f.name in preset]
    default = ", ".join(by_preset + [f"else {f.default}"]) if by_preset else f.default
    if default == "":  # "" defaults are explained in the help
        return f.metadata["help"]
    return f.metadata["help"] + f" (default: {default})"


def check(f: dataclasses.Field, v, error):
    """A setting's value against what the tensors that take it can hold (a finite float32 or an
    int64), then against its rule."""
    flag = "--" + f.name.replace("_", "-")
    if isinstance(v, float) and not abs(v) <= FLOAT32_MAX:  # NaN fails too
        error(f"{flag} {v!r}: expected a finite float32")
    if isinstance(v, int) and not abs(v) < 2**63:
        error(f"{flag} {v!r}: expected an int64")
    test, expected = f.metadata["valid"] or (lambda v: True, "")
    if not test(v):
        error(f"{flag} {v!r}: expected {expected}")


def refuse_conflicts(cfg, error):
    """A refusal (error: one line, exit 2) for settings that each pass their rule but cannot go
    together."""
    if cfg.resume and cfg.overwrite:
        error("--resume and --overwrite: pick one (--resume continues the run, --overwrite "
              "replaces it)")
    if not cfg.arith_traps and int(cfg.arith_steps.split("-")[1]) > 8:  # totals 0-9 unwrapped
        error(f"--arith-steps {cfg.arith_steps}: at most 8 steps without --arith-traps")
    if 0 < cfg.mc_max_rollouts < cfg.mc_rollouts:
        error(f"--mc-max-rollouts {cfg.mc_max_rollouts}: below --mc-rollouts {cfg.mc_rollouts} "
              "(round 1)")
    if cfg.mc_top_up and (not cfg.mc_reuse or cfg.mc_max_rollouts):
        error("--mc-top-up counts the responses as continuations: it needs --mc-reuse, not "
              "--mc-max-rollouts")
    if cfg.system and not cfg.chat:
        error("--system: a system turn needs --chat (the tokenizer's chat template)")
    if cfg.value_head and cfg.algo not in ("ppo", "tppo"):
        error(f"--value-head {cfg.value_head!r}: only ppo and tppo have a critic, not {cfg.algo}")
    if cfg.algo == "tppo" and cfg.value_head == "scalar":
        error("--algo tppo --value-head scalar: exactly --algo ppo (TPPO is GAE on the tracking "
              "head); use --algo ppo")
    if cfg.critic_warmup and cfg.algo not in ("ppo", "tppo"):
        error(f"--critic-warmup {cfg.critic_warmup}: only ppo and tppo have a critic to warm up; "
              f"under {cfg.algo} the policy would stand still for {cfg.critic_warmup} iterations")
    if cfg.critic_warmup and cfg.critic_warmup >= cfg.iterations > 0:
        error(f"--critic-warmup {cfg.critic_warmup}: at least --iterations {cfg.iterations}; "
              "the policy would never train (give fewer warm-up iterations or more iterations)")
    if cfg.algo == "grpo" and cfg.samples_per_prompt == 1:
        error("--samples-per-prompt 1: GRPO's advantage is a reward less its group's mean, "
              "always 0 in a group of one; give at least 2")


def ignored(cfg) -> dict:
    """The settings this run does not read, each with why (the first reason that applies)."""
    why = {}

    def because(reason: str, *names: str):
        for name in names:
            why.setdefault(name, reason)

    if cfg.algo not in ("ppo", "tppo"):
        because(f"only ppo and tppo have a critic and GAE, not {cfg.algo}",
                "critic_lr", "lam_critic", "value_clip", "gamma", "lam")
    if cfg.value_head != "scalar":
        because(f"the {cfg.value_head} head learns the outcome itself: no GAE targets, no value "
                "clipping", "value_clip", "lam_critic")
    if cfg.algo != "vineppo":
        because(f"only vineppo has MC values, not {cfg.algo}", "mc_rollouts", "max_value_states",
                "mc_max_rollouts", "mc_increment", "mc_ci_width", "mc_reuse", "mc_top_up")
    if not cfg.mc_max_rollouts:
        because("adaptive MC values are off: --mc-max-rollouts 0", "mc_increment", "mc_ci_width")
    if cfg.data != "arith":
        because(f"the built-in task's, not --data {cfg.data}'s", "arith_steps", "arith_slip",
                "arith_traps")
    return why


def warn_ignored(cfg, given: dict):
    """A warning for each setting the command line gave (not a preset) that this run ignores."""
    for name, why in ignored(cfg).items():
        if name in given:
            print(f"warning: --{name.replace('_', '-')} {getattr(cfg, name)}: ignored ({why})",
                  file=sys.stderr)


def given_flags(config, words: list[str]) -> list[str]:
    """The flags of `config`'s command line that `words` give, as argparse reads them.
    So an abbreviation (--se 5) or --seed=5 counts as --seed; a malformed line gives none (the
    command's own check says why)."""
    p = command_line(config, (), "", add_help=False)
    p.error = malformed
    try:
        known, _ = p.parse_known_args(join_negative_numbers(words))
    except ValueError:
        return []
    return ["--" + k.replace("_", "-") for k, v in vars(known).items() if v is not None]


def malformed(message: str):
    """An argparse error as an exception, for a parser that must not exit."""
    raise ValueError(message)


# ---- what a resumed run may change ----------------------------------------------------------

PROBLEMS = "the run would train or evaluate on other problems or prompts than its rows so far"
# refused on --resume, each with why; a setting the run does not use is not compared (unused)
KEPT_ON_RESUME = {
    **dict.fromkeys(("data", "eval_data", "eval_problems", "max_prompt_tokens", "arith_steps",
                     "arith_slip", "arith_traps", "prompt_template", "chat", "system", "answer"),
                    PROBLEMS),
    **dict.fromkeys(("model", "sft_steps", "sft_lr", "sft_batch"),
                    "the policy and its KL reference were made from it"),
    **dict.fromkeys(("algo", "value_head"), "the checkpoint holds that method's learners (a "
                                            "critic and its head, or none)"),
    "fsdp": "the checkpoint's optimizer states are saved in its format",
    "seed": "each iteration's problems are drawn with --seed + iteration",
    **dict.fromkeys(("lr", "critic_lr", "warmup"),
                    "its optimizers and LR schedules were built with {written}"),
    "critic_warmup": "the policy's LR schedule was built to begin after it",
}
# where and how a run is started, its length (said on its own) and its files: no history
NOT_RECORDED = ("out", "resume", "overwrite", "iterations", "data_files")


def defaults(config) -> dict:
    """Each setting's default (a preset's not applied)."""
    return {f.name: f.default for f in dataclasses.fields(config)}


def unused(cfg) -> set:
    """The settings this run does not read: those ignored() names, and SFT's without SFT."""
    return set(ignored(cfg)) | ({"sft_lr", "sft_batch"} if not cfg.sft_steps else set())


def refused_on_resume(cfg, written: dict) -> str:
    """Why a run cannot resume with cfg ('' if it can): the first setting of KEPT_ON_RESUME that
    differs from the one `written` (its config.json) records, and why."""
    default, skipped = defaults(cfg), unused(cfg)
    for key, why in KEPT_ON_RESUME.items():
        before, now = written.get(key, default[key]), getattr(cfg, key)  # newer: its default
        if before != now and key not in skipped:
            return (f"written with --{key.replace('_', '-')} {before!r}, not {now!r}; "
                    + why.format(written=repr(before)))
    return ""


def with_history(written: dict, now: dict, first: int, skip: set) -> tuple[dict, list[str]]:
    """A resumed run's config.json, and its changes in words.

    `now`'s settings, with "history": each setting that has changed, its values and the
    iteration each took effect from. A value recorded from after the checkpoint (iteration
    `first` - 1) is dropped, as its rows are: that stretch is run again. `skip`: the settings
    the run does not use."""
    history = {key: [entry for entry in entries if entry["from_iteration"] < first]
               for key, entries in written.get("history", {}).items()}
    changes = []
    for key, value in now.items():
        if key in NOT_RECORDED or key in skip:
            continue
        entries = history.get(key) or [{"from_iteration": 0, "value": written.get(key)}]
        if entries[-1]["value"] != value:
            history[key] = entries + [{"from_iteration": first, "value": value}]
            changes.append(f"--{key.replace('_', '-')} {value!r} ({entries[-1]['value']!r} "
                           "before)")
    history = {key: entries for key, entries in history.items() if len(entries) > 1}
    return ({**now, "history": history} if history else now), changes


def steps_per_iteration(settings: dict) -> int:
    """Optimizer steps an iteration takes: --epochs passes over its episodes in minibatches."""
    return settings["epochs"] * math.ceil(settings["prompts_per_iter"]
                                          * settings["samples_per_prompt"] / settings["minibatch"])
