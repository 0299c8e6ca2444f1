"""The run's engineering, apart from the algorithm's files: a first reading skips this folder.

What each file holds:
- start.py: before the first iteration, the --out lock, data, models, optimizers, or a resumed
  run; a run's exit;
- settings.py: how a setting is declared, shown in --help and checked; the settings a run
  ignores;
- tasks.py: the problems (the built-in task, .jsonl files, GSM8K and MATH from the hub) and
  draw_problems;
- prompts.py: the prompt (--prompt-template, --chat, --system), the ids that end a turn;
- models.py: loading a model (hub id, directory, .gguf, the tiny one), dropout off, --precision;
- sft.py: the SFT warm start, demonstrations in --answer's style, a loss on the response only;
- outputs.py: the folders a run, diagnose.py and bench.py may write into (empty, or their own);
- checkpoint.py: atomic checkpoints, config.json, what --resume checks and restores;
- parallel.py: torchrun (DDP or FSDP2), the collectives (no-ops in one process), the metrics
  row and the update's statistics.
A run's life through them: docs/runs-that-survive.md.

Most of it only refuses bad input or keeps a run alive (the --out lock, resume, atomic saves,
one-line errors). What it decides that changes the numbers:
- tasks.draw_problems: which prompts an iteration takes (seed + iteration, a share a process);
- prompts.encode_prompt, prompts.stop_ids, prompts.drop_long_prompts: the prompt's tokens (the
  tokenizer's BOS first), the ids that end a response, the problems too long to keep;
- models.without_dropout, models.default_precision, models.cast_linear_weights: no dropout,
  bf16 on a GPU and fp32 on a CPU, a frozen model's weights in bf16;
- sft.sft_example, sft.sft_warm_start: the SFT start (a loss on the response's tokens only);
- start.load_run, start.fit_prompts_per_iter: the KL reference and the critic's backbone
  copied from the policy after SFT, the LR schedule sized to the prompts that run;
- parallel.wrap: DDP or FSDP2 (the update's gradient across processes: ppo.py)."""
