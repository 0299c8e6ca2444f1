"""VinePPO's credit assignment (Kazemnejad et al. 2024, arXiv 2410.01679, §4): from every step boundary s_i
of a response, K more continuations; every token of step i takes A_i (the KL term lives in the loss):

    V_hat(s_i) = 1/K sum_k R(s_i + continuation_k)                        (unbiased MC value)
    A_i        = r_i + V_hat(s_{i+1}) - V_hat(s_i),  r_i = R * [i = n-1],  V(s_n) = 0  (gamma = 1)
"""
import re
from bisect import bisect_right
from itertools import accumulate

import torch
from tqdm import tqdm

import rollout


def step_starts(token_texts: list[str]) -> list[int]:
    """Token index where each step starts, by the reference's rule (tasks/gsm8k.py) on the tokens' text: a
    step opens at each line; leading empty lines join the first; the last non-empty line, empty lines after
    it and the answer ('\\n####') form one; a token is in its first character's step (reference pitfall 5)."""
    text = "".join(token_texts)
    answer_at = text.find("\n####")
    lines = (text if answer_at < 0 else text[:answer_at]).split("\n")
    nonempty = [i for i, line in enumerate(lines) if line.strip()]
    opens = []  # character positions of the '\n' that opens a step
    if nonempty:
        last = nonempty[-1] if answer_at >= 0 else len(lines) - 1
        opens = [sum(len(line) + 1 for line in lines[:i]) - 1 for i in range(nonempty[0] + 1, last + 1)]
    return token_steps(token_texts, opens)


def token_steps(token_texts: list[str], opens: list[int]) -> list[int]:
    """Token index where each step starts, given the character positions `opens` where steps 2.. start."""
    firsts = list(accumulate((len(piece) for piece in token_texts), initial=0))[:-1]  # each token's first char
    steps = [bisect_right(opens, char) for char in firsts]  # steps opened at or before it
    return [0] + [t for t in range(1, len(steps)) if steps[t] != steps[t - 1]]


def decoded_pieces(tok, ids: list[int]) -> list[str]:
    """The text each token adds to the decoded sequence (alone, '▁' decodes to ''), as vLLM detokenizes."""
    decode = tok.backend_tokenizer.decode if hasattr(tok, "backend_tokenizer") else tok.decode
    pieces, start, read, shown = [], 0, 0, ""  # the window is ids[start:]; shown = its text up to read
    for t in range(len(ids)):
        text = decode(ids[start: t + 1], skip_special_tokens=True)
        if len(text) > len(shown) and not text.endswith("\ufffd"):
            pieces.append(text[len(shown):])
            start, read = read, t + 1
            shown = decode(ids[start:read], skip_special_tokens=True)
        else:
            pieces.append("")
    return pieces


def response_step_starts(tok, response_ids: list[int], math: bool = False) -> list[int]:
    """By GSM8K's rule (one line a step), or by MATH's (math: sentences and lines, LaTeX kept whole)."""
    pieces = decoded_pieces(tok, response_ids)
    return token_steps(pieces, math_step_offsets("".join(pieces))[1:-1]) if math else step_starts(pieces)


# ---- MATH's steps (reference: tasks/math_extract_steps_inplace.py split_solution_inplace) ------------------
# LaTeX spans, hidden in this order behind placeholders of 60 characters (the reference's length, on which its
# length rules depend); math ending a sentence ends a step; parts that are only a math opener join the next.
MATH_SPANS = [r"\[asy\].*?\[/asy\]", r"\$\\begin\{tabular\}.*?\\end\{tabular\}\$",
              r"\\begin\{tabular\}.*?\\end\{tabular\}", r"\\\(.*?\\\)", r"\\\[.*?\\\]",
              r"\$\$.*?\$\$", r"(?<!\\)\$.*?[^\\]\$(?!\$)", r"\\begin\{([^}]*)\}.*?\\end\{\1\}"]
PLACEHOLDER = re.compile(r"<\|\d{56}\|>")
MATH_ENDS = (".$", ".$$", ".\\)", ".\\]")
OPENER = re.compile(r"\$|\$\$|\\\(|\\\[|\\begin\{[^}]*\}|\[asy\]")
SENTENCE_END = r"(?<!\b[A-Za-z]\.)(?<!\s[A-Za-z]\.)(?<!\s[A-Za-z][A-Za-z]\.)(?<=\.)(?=\s+[A-Z])"  # not 'e.g.'
PROSE_CUTS = [(",", 1), (r"\sand\s", 4), (":", 1), (r"\sto\s", 3)]  # (pattern, cut after n characters)
MATH_CUTS = [(r",\$", 2), (r",\\\)", 3), (r",\\\]", 3), ("=", 1), (r"\\equiv", 6), (r"\+", 1),
             (r"\\cancelto", 9)]


def hide_math(text: str) -> tuple[str, dict]:
    """(text with each LaTeX span replaced by a placeholder, {placeholder: span}); equal spans share one."""
    found = {}
    hide = lambda m: found.setdefault(m.group(0), f"<|{len(found):056d}|>")
    for pattern in MATH_SPANS:
        text = re.sub(pattern, hide, text, flags=re.S)
    return text, {placeholder: span for span, placeholder in found.items()}


def show_math(text: str, spans: dict) -> str:
    while PLACEHOLDER.search(text):  # a span may hold an earlier one
        text = PLACEHOLDER.sub(lambda m: spans[m.group(0)], text)
    return text


def merge_short(bounds: list[int], short) -> list[int]:
    """Remove the boundary after each part short(start, end) (before it, for the last part): it joins one."""
    i = 0
    while i < len(bounds) - 1:
        if short(bounds[i], bounds[i + 1]):
            bounds.pop(i if i == len(bounds) - 2 else i + 1)
        else:
            i += 1
    return bounds


def math_step_offsets(text: str) -> list[int]:
    """[0, start of step 2, ..., len(text)]: the reference's steps of a MATH solution, in five passes."""
    hidden, spans = hide_math(text)
    # 1-2. sentence ends and newlines (a newline opens its part); a lone newline or a short part without
    #      a full stop joins the next (the last part stays)
    pieces = [piece if i == 0 else "\n" + piece for sentence in re.split(SENTENCE_END, hidden)
              for i, piece in enumerate(sentence.split("\n"))]
    short = lambda a, b: b < len(hidden) and (hidden[a:b] == "\n" or
                                              b - a < 20 and not hidden[a:b].endswith("."))
    bounds = merge_short(list(accumulate(map(len, pieces), initial=0)), short)
    # 3. a cut after math that ends a sentence; then parts under 20 characters, math shown, join a neighbour
    after_math = lambda a, b: [a + m.end() for m in PLACEHOLDER.finditer(hidden[a:b])
                               if spans[m.group(0)].endswith(MATH_ENDS)]
    bounds = [0] + [cut for a, b in zip(bounds, bounds[1:]) for cut in after_math(a, b) + [b]]
    shown = lambda a, b: show_math(hidden[a:b], spans)
    bounds = merge_short(bounds, lambda a, b: len(shown(a, b)) < 20 and not shown(a, b).endswith(MATH_ENDS))
    # 4. math shown again (offsets into `text` from here), a cut at each newline inside a span; parts that
    #    are only an opener or under 3 characters join a neighbour
    shown_bounds = [0]
    for a, b in zip(bounds, bounds[1:]):
        start, part = shown_bounds[-1], hidden[a:b]
        while m := PLACEHOLDER.search(part):
            span = show_math(spans[m.group(0)], spans)
            shown_bounds += [start + m.start() + n.start() for n in re.finditer("\n", span)]
            part = part.replace(m.group(0), span)
        shown_bounds.append(start + len(part))
    bounds = merge_short(shown_bounds, lambda a, b: b - a < 3 or OPENER.fullmatch(text[a:b].strip()))
    # 5. a part over 100 characters is cut near its middle, again and again
    bounds = [0] + [a + cut for a, b in zip(bounds, bounds[1:])
                    for cut in (break_long(text[a:b])[1:] if b - a > 100 else [b - a])]
    return bounds if len(bounds) > 1 and bounds[-1] == len(text) else [0, len(text)]


def break_long(part: str) -> list[int]:
    """Cuts of a long part: each piece over 100 characters is cut at the prose candidate nearest its middle
    (math hidden, both sides >= 40), else at the math one (both sides >= 20). A piece that starts in the range
    [first math cut, longest piece math-cut] skips prose (the reference's range, in piece-relative offsets)."""
    cuts, math_from, math_to, i = [0, len(part)], None, 0, 0
    while i < len(cuts) - 1:
        a, b = cuts[i], cuts[i + 1]
        cut = None
        if b - a > 100:
            if math_from is None or not math_from <= a < math_to:
                cut = prose_cut(part[a:b])
            if cut is None:
                cut = middle_cut(part[a:b], MATH_CUTS, 20)
                if cut is not None:
                    math_from, math_to = min(cut, cut if math_from is None else math_from), max(math_to, b - a)
        if cut is None:
            i += 1
        else:
            cuts.insert(i + 1, a + cut)
    return cuts


def prose_cut(piece: str) -> int | None:
    hidden, spans = hide_math(piece)
    shown_len = lambda s: len(show_math(s, spans))
    cut = middle_cut(hidden, PROSE_CUTS, 40, shown_len)
    return None if cut is None else shown_len(hidden[:cut])


def middle_cut(text: str, patterns, shortest: int, length=len) -> int | None:
    """The candidate of the first pattern that has one nearest the middle, if both sides are long enough."""
    for pattern, n in patterns:
        cuts = [m.start() + n for m in re.finditer(pattern, text)]
        if cuts:
            cut = min(cuts, key=lambda c: abs(2 * c - len(text)))
            if min(length(text[:cut]), length(text[cut:])) >= shortest:
                return cut
    return None


def step_advantages(values: list[float], reward: float) -> list[float]:
    """A_i = r_i + V(s_{i+1}) - V(s_i) (VinePPO §4); a None value (past the cap) takes the realised return."""
    v = list(values) + [0.0]
    for i in reversed(range(len(values))):
        if v[i] is None:
            v[i] = (reward if i == len(values) - 1 else 0.0) + v[i + 1]
    n = len(values)
    return [(reward if i == n - 1 else 0.0) + v[i + 1] - v[i] for i in range(n)]


def token_advantages(starts: list[int], step_adv: list[float], n_tokens: int) -> list[float]:
    bounds = starts[1:] + [n_tokens]
    return [a for a, lo, hi in zip(step_adv, starts, bounds) for _ in range(hi - lo)]


def mc_values(model, episodes: list[rollout.Episode], cache, rows: list[int], k: int,
              grade, *, max_new_tokens: int, max_states: int, **gen):
    """ep.values[i] = V_hat(s_i) of the first max_states states, forked from `cache` (row rows[e]), each
    distinct state once, graded with its prefix (reference pitfall 4); -> (states, tokens generated)."""
    unique = {}  # state tokens -> (episode, boundary)
    for e, ep in enumerate(episodes):
        for b in ep.step_starts[:max_states or None]:
            unique.setdefault(tuple(ep.prompt_ids + ep.response_ids[:b]), (e, b))
    keys = list(unique)
    budgets = [max_new_tokens - unique[key][1] for key in keys]
    conts, finished = rollout.sample(model, [list(key) for key in keys], k, budgets, cache=cache,
                                     rows=[rows[unique[key][0]] for key in keys], **gen)
    value = {}
    for key, cs, fs in zip(keys, conts, finished):
        e, b = unique[key]
        ep = episodes[e]
        value[key] = sum(grade(ep.response_ids[:b] + c, ep) if f else 0.0 for c, f in zip(cs, fs)) / k
    capped = lambda i: max_states and i >= max_states  # max_states 0: no cap
    for ep in episodes:
        ep.values = [None if capped(i) else value.get(tuple(ep.prompt_ids + ep.response_ids[:b]))
                     for i, b in enumerate(ep.step_starts)]
    return len(keys), sum(len(c) for cs in conts for c in cs)


def old_logprobs_and_values(policy, critic, episodes, grade, *, algo: str, temperature: float, mc_rollouts: int,
                            max_value_states: int, forward_batch_tokens: int, autocast, **gen) -> dict:
    """ep.old_logp, and MC values or a critic's V(s_t), from one forward pass per chunk (its cache forked)."""
    n_states = mc_tokens = 0
    device = next(policy.parameters()).device
    for chunk in tqdm(list(rollout.group_chunks(episodes, forward_batch_tokens)), desc="values", leave=False):
        ids, mask = rollout.pad_right([ep.prompt_ids + ep.response_ids for ep in chunk], gen["pad_id"], device)
        with torch.no_grad(), autocast:
            logp, cache = rollout.token_logprobs(policy, ids, mask, temperature, keep_cache=algo == "vineppo")
            if algo == "vineppo":
                states, tokens = mc_values(policy, chunk, cache, list(range(len(chunk))), mc_rollouts, grade,
                                           max_states=max_value_states, temperature=temperature, **gen)
                n_states, mc_tokens = n_states + states, mc_tokens + tokens
            if critic is not None:
                prompt_lens = torch.tensor([len(ep.prompt_ids) for ep in chunk], device=device)
                for ep, v in zip(chunk, rollout.per_response(critic.values(ids, mask, prompt_lens), chunk)):
                    ep.old_values = v
        for ep, lp in zip(chunk, rollout.per_response(logp, chunk)):
            ep.old_logp = lp
        del cache  # before the next chunk's forward pass allocates its own
    return {"mc_states": n_states, "mc_tokens": mc_tokens}
