"""This file samples with HF `generate`, and decides each row's budget and where it is cut.

- generate samples from softmax(logits / T) with top-p, and uses none of the model's own settings.
- within_context cuts a row's budget to what the model's context leaves.
- finish cuts a row after its end id, to its budget, and before the stop string.
rollout.sample_by_definition samples with these three alone. fork.py gets the same
continuations faster, from a KV cache.
Below the separator line: the stop string's cut, and generate's settings.
"""
from transformers import GenerationConfig


def within_context(model, prefixes, budgets: list[int]) -> list[int]:
    """Cut each budget to what the model's context leaves after its prefix."""
    context = model.config.max_position_embeddings
    return [max(0, min(b, context - len(p))) for b, p in zip(budgets, prefixes)]


def generate(model, sampling, **inputs):
    """Call HF `generate` with decoding's settings and no others.

    It samples softmax(logits / T) with top-p, or takes the argmax when greedy. At top-p 1 this
    is exactly the distribution the log-probs model. generate fills every setting that a call
    leaves unset (repetition_penalty, min_p, top_k, ...) from model.generation_config, even when
    it is given a GenerationConfig. So model.generation_config is set aside during the call."""
    own, model.generation_config = model.generation_config, GenerationConfig()  # all unset
    try:
        return model.generate(**inputs, **decoding(sampling))
    finally:
        model.generation_config = own


def finish(seq: list[int], budget: int, end_ids, tokenizer=None, stop: str | None = None,
           before=()):
    """Cut a row after its first end id, to its budget, and before `stop`; say if it finished.

    - end_ids is one id or several (Sampling.stops). Any of them ends a row. The stop string's
      cut appends the first.
    - generate pads a row that stopped early with eos_id (decoding's pad_token_id). So whatever
      follows the first end id is padding.
    - A row is finished when it ends in an end id, that is, when it stopped by itself within
      its budget."""
    ends = (end_ids,) if isinstance(end_ids, int) else tuple(end_ids)
    first = next((t for t, token in enumerate(seq) if token in ends), None)
    seq = (seq if first is None else seq[: first + 1])[:budget]
    if stop:
        seq = cut_before_stop(seq, ends, tokenizer, stop, before)
    return seq, bool(seq) and seq[-1] in ends


# ---- engineering: the stop string, generate's settings (skip on a first reading)


def cut_before_stop(seq: list[int], ends: tuple, tokenizer, stop: str, before) -> list[int]:
    """Cut seq before the stop string and append ends[0]; leave seq as it is when it has none.

    - Text after the stop string is a next problem that the model began to invent. It is cut.
    - The stop string counts if it ends in the row, even if it begins in the prefix `before`.
      generate sees it the same way. So an MC continuation stops, and is cut, where its
      response would have.
    - HF stops at the token that completes `stop`, the row's last. Each token adds at least one
      character, so `stop` lies in the last len(stop) tokens of prefix + row.
    - The token where `stop` begins is cut too, with any text of its own before `stop`.
      Byte-level BPE can merge punctuation and newlines, so a '.\\n\\n' token loses its '.'."""
    body = seq[:-1] if seq and seq[-1] in ends else seq
    tail = list(before)[-len(stop):]
    joined = tail + body
    text = lambda lo, hi=None: tokenizer.decode(joined[lo:hi], skip_special_tokens=True)
    window = max(0, len(joined) - len(stop))
    if stop not in text(window) or stop in text(window, len(tail)):  # none, or the prefix's
        return seq
    start = len(joined) - 1
    while stop not in text(start):  # the last token whose text, and what follows, has `stop`
        start -= 1
    return body[:max(0, start - len(tail))] + [ends[0]]  # begun in the prefix: EOS alone


def decoding(sampling) -> dict:
    """The settings `generate` gets in every sampling call.

    - Any stop id or the stop string ends a row.
    - synced_gpus is False, so each process decodes on its own. With FSDP, HF would otherwise
      lock the processes together.
    - top_k is 0, since generate's default top_k=50 would sample from a distribution that the
      log-probs do not model."""
    stopping = dict(eos_token_id=list(sampling.stops), pad_token_id=sampling.eos_id,
                    stop_strings=sampling.stop, tokenizer=sampling.tokenizer, synced_gpus=False)
    if sampling.temperature > 0:
        return dict(stopping, do_sample=True, temperature=sampling.temperature,
                    top_p=sampling.top_p, top_k=0)
    return dict(stopping, do_sample=False)
