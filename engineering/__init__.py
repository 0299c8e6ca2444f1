"""The run's engineering, apart from the algorithm's files: a first reading skips this folder.

What each file holds: the README's table of files; a run's life through them:
docs/runs-that-survive.md. Most of it only refuses bad input or keeps a run alive (the --out
lock, resume, atomic saves, one-line errors). What it decides that changes the numbers:
- tasks.draw_problems: which prompts an iteration takes (seed + iteration, a share a process);
- prompts.encode_prompt, prompts.stop_ids, prompts.drop_long_prompts: the prompt's tokens (the
  tokenizer's BOS first), the ids that end a response, the problems too long to keep;
- models.without_dropout, models.default_precision, models.cast_linear_weights: no dropout,
  bf16 on a GPU and fp32 on a CPU, a frozen model's weights in bf16;
- sft.sft_example, sft.sft_warm_start: the SFT start (a loss on the response's tokens only);
- start.load_run, start.fit_prompts_per_iter: the KL reference and the critic's backbone
  copied from the policy after SFT, the LR schedule sized to the prompts that run;
- parallel.wrap: DDP or FSDP2 (the update's gradient across processes: ppo.py)."""
