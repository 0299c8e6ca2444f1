"""The models a run trains: the tiny demo model, any model a user brings (a hub id, a
save_pretrained directory or a .gguf file), dropout off, --precision, and the model's own
generation settings that sampling sets aside.

Needs: tasks.py (DataError), fork.py (which caches can be forked), parallel.py. All
engineering: a first reading may skip this file (docs/your-own-model.md tells its settings)."""
import os
import re
from contextlib import nullcontext

import torch
from torch import nn
from tqdm import tqdm

import fork
from engineering import parallel
from engineering.tasks import DataError, first_line

ALIASES = {"rho-math-1.1b": "realtreetune/rho-1b-sft-GSM8K"}  # the reference's SFT checkpoint

MATH_ALIASES = {"rho-math-1.1b": "realtreetune/rho-1b-sft-MATH"}  # and its MATH one (--data math)


def build_tiny_model(path: str, seed: int):
    """A 4-layer, 128-wide random Llama with a character-level tokenizer, saved as a hub model
    would be."""
    from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers
    from tokenizers import models as token_models
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    chars = ["\n"] + [chr(c) for c in range(32, 127)]
    vocab = {t: i for i, t in enumerate(["<pad>", "<s>", "</s>", "<unk>"] + chars)}
    tk = Tokenizer(token_models.WordLevel(vocab, unk_token="<unk>"))
    # one token per char
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    tk.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>",
                                  pad_token="<pad>", unk_token="<unk>")
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=128, intermediate_size=384,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                         max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
                         pad_token_id=0, tie_word_embeddings=True)
    LlamaForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)


def load_model(name: str, device, trust_remote_code=False, resuming: bool = False,
               flag: str = "--model"):
    """(tokenizer, model) from a hub id or a directory; resuming: a directory of the run in --out;
    flag: the setting that named it, for the messages."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    if name.endswith(".gguf"):
        return load_gguf(name, device, flag)
    # a hub id is 'name' or 'owner/name';
    # anything else (./x, /x, a/b/c) can only be a local directory
    hub_id = re.fullmatch(r"[\w.-]+(/[\w.-]+)?", name) and not name.startswith(".")
    try:
        if (resuming or not hub_id) and not os.path.isdir(name):
            raise FileNotFoundError("no such directory")
        if os.path.isdir(name) and not os.path.exists(os.path.join(name, "config.json")):
            raise FileNotFoundError("a directory without config.json: expected one written by "
                                    "save_pretrained (model and tokenizer)")
        try:
            tok = AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code)
            # a tokenizer_config.json without its vocabulary loads as a tokenizer of no text
            if not encodes_text(tok):
                raise ValueError(f"its tokenizer encodes {PLAIN!r} to no token but unknown ones")
        except Exception as e:  # no tokenizer files: "Couldn't instantiate the backend tokenizer"
            raise without_tokenizer(name, e) from None
        config = without_dropout(AutoConfig.from_pretrained(name,
                                                            trust_remote_code=trust_remote_code))
        model = AutoModelForCausalLM.from_pretrained(name, config=config, dtype=torch.float32,
                                                     trust_remote_code=trust_remote_code)
        model.to(device)
    except Exception as e:  # hub, network and format errors all end here: one line, not a traceback
        if resuming:  # the run's own files, not a setting the user gave
            from engineering.checkpoint import start_again  # (checkpoint imports this file)
            raise start_again(f"{name} cannot be loaded ({first_line(e)})") from None
        if isinstance(e, FileNotFoundError):
            raise DataError(f"{flag} {name!r}: {first_line(e)}") from None
        local = "" if os.path.isdir(name) else "no local directory of that name, nor on the hub: "
        raise DataError(f"{flag} {name!r}: cannot load it ({local}{first_line(e)}); offline, point "
                        f"{flag} at a local directory written by save_pretrained (model and "
                        f"tokenizer); also accepted: 'tiny', {', '.join(sorted(ALIASES))} or a "
                        "reachable hub id") from None
    rows = model.get_input_embeddings().num_embeddings
    if rows < len(tok):  # a token id past the embedding's rows: an IndexError in the first pass
        raise DataError(f"{flag} {name!r}: its config.json's vocab_size {rows} is smaller than its "
                        f"tokenizer's {len(tok)} tokens; expected a vocab_size of at least "
                        f"{len(tok)}, a row of the embedding for every token id")
    return tok, model


PLAIN = "Question: 12 + 30 = 42"  # text any tokenizer of a language model encodes


def encodes_text(tok) -> bool:
    """Whether the tokenizer encodes plain text to at least one token other than its unknown one."""
    return any(i != tok.unk_token_id for i in tok(PLAIN, add_special_tokens=False).input_ids)


# what save_pretrained writes for a fast tokenizer; the files that can hold a tokenizer's vocabulary
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")

VOCABULARIES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")


def without_tokenizer(name: str, error: Exception) -> Exception:
    """Why the tokenizer of name did not load: for a directory without one, the files it lacks.

    A run's folder (OUT, not OUT/checkpoint) is said to be one; any other error is kept as it is."""
    found = lambda file: os.path.exists(os.path.join(name, file))
    if not os.path.isdir(name) or any(found(file) for file in VOCABULARIES):
        return error
    missing = ", ".join(file for file in TOKENIZER_FILES if not found(file))
    if os.path.isdir(os.path.join(name, "checkpoint")):
        inside = os.path.join(name, "checkpoint")
        return FileNotFoundError(f"a run's folder, not a model (missing: {missing}); its "
                                 f"checkpoint/ holds them, with the weights: give {inside}")
    return FileNotFoundError(f"no tokenizer in it (missing: {missing}); a run's checkpoint/ holds "
                             "them beside the weights (tokenizer.save_pretrained writes them)")


def without_dropout(config):
    """The config with every dropout probability 0 (GPT-2's attn_pdrop, Llama's
    attention_dropout, ...), its sub-configs' too: old and new log-probs, the reference's and the
    critic's come from one network."""
    for key, v in vars(config).items():
        # a sub-config (a multimodal model's text part)
        if hasattr(v, "to_dict") and hasattr(v, "model_type"):
            without_dropout(v)
        elif isinstance(v, float) and ("dropout" in key or "pdrop" in key):
            setattr(config, key, 0.0)
    return config


def load_gguf(path: str, device, flag: str = "--model"):
    """(tokenizer, model) of a .gguf file, de-quantised to fp32 by transformers' GGUF reader (it
    needs the gguf package); built from its config, so accelerate is not needed."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    if os.path.isdir(path):
        raise DataError(f"{flag} {path!r}: a directory, not a .gguf file")
    if not os.path.isfile(path):
        raise DataError(f"{flag} {path!r}: no such file")
    folder, file = os.path.split(os.path.abspath(path))
    try:
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=file)
        config = without_dropout(AutoConfig.from_pretrained(folder, gguf_file=file))
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        tensors = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)["tensors"]
        missing, unexpected = model.load_state_dict(
            {k: torch.as_tensor(v) for k, v in tensors.items()}, strict=False)
        model.tie_weights()
        tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
        if set(missing) - tied or unexpected:
            raise ValueError(f"weights missing {sorted(set(missing) - tied)[:3]}, "
                             f"unexpected {unexpected[:3]}")
    except Exception as e:
        # no gguf package, an architecture transformers cannot read from GGUF, a bad file
        raise DataError(f"{flag} {path!r}: cannot load it as GGUF ({first_line(e)}); it needs the "
                        "gguf package (pip install gguf)") from None
    return tok, model.to(device)

PRECISIONS = ("fp32", "bf16")


def default_precision(device: torch.device) -> str:
    """bf16 on CUDA (the reference's); fp32 elsewhere: the CPU demo keeps its exact numbers."""
    return "bf16" if device.type == "cuda" else "fp32"


def autocast(device: torch.device, precision: str):
    assert precision in PRECISIONS, precision
    return (torch.autocast(device.type, dtype=torch.bfloat16) if precision == "bf16"
            else nullcontext())


def cpu_has_bf16() -> bool:
    """Whether torch multiplies bf16 matrices on this CPU with oneDNN (it needs AVX-512 or AMX)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a torch without the check: assume it does
        return True


def warn_if_bf16_is_emulated(device: torch.device, precision: str):
    """One line when --precision bf16 runs on a CPU where oneDNN cannot multiply bf16.

    There torch multiplies bf16 matrices in plain loops, many times slower than fp32."""
    if precision == "bf16" and device.type == "cpu" and not cpu_has_bf16() \
            and parallel.rank() == 0:
        tqdm.write("warning: --precision bf16: this CPU has neither AVX-512 nor AMX, so torch "
                   "multiplies bf16 matrices without oneDNN, many times slower than fp32 "
                   "(--precision fp32)")


def cast_linear_weights(model, precision: str):
    """bf16: a frozen model's nn.Linear weights in bf16, which autocast casts anyway: the same
    numbers (KL 0 at equal weights) in half the memory. Not model.to(bf16): norms and RoPE would
    round too."""
    if precision == "bf16":
        embedding = model.get_input_embeddings().weight
        for module in model.modules():
            # a tied one is read uncast
            if isinstance(module, nn.Linear) and module.weight is not embedding:
                module.to(torch.bfloat16)
    return model


# generation settings a model may set, at values that leave softmax(logits / T) as is
NEUTRAL = dict(do_sample=False, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, typical_p=1.0,
               epsilon_cutoff=0.0, eta_cutoff=0.0, repetition_penalty=1.0, no_repeat_ngram_size=0,
               num_beams=1, min_length=0, length_penalty=1.0, use_cache=True,
               output_attentions=False, output_hidden_states=False)


NOT_SETTINGS = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id",
                "transformers_version")


def overridden_settings(model) -> dict:
    """The settings of model.generation_config that generate sets aside: those not
    neutral. Its token ids are kept apart: its EOS ids end responses (prompts.stop_ids)."""
    own = sorted(model.generation_config.to_dict().items())
    return {key: value for key, value in own if value is not None and value != NEUTRAL.get(key)
            and key not in NOT_SETTINGS and not key.startswith("_")}


def announce_overridden_settings(model, rank: int):
    """One line, from the first process, naming the model's own generation settings
    that sampling does not use (overridden_settings); none: no line."""
    own = overridden_settings(model)
    if own and rank == 0:
        shown = ", ".join(f"{key}={value!r}" for key, value in own.items())
        tqdm.write(f"the model's generation_config sets {shown}: not used; responses, MC "
                   "continuations and evaluation sample softmax(logits / T) with --temperature "
                   "and --top-p (T = 0: greedy)")


def announce_fork(cfg, policy):
    """One line when the policy's KV cache cannot be forked (sliding-window layers, or any the fork
    does not know): every continuation then encodes its prefix afresh, with the same numbers, more
    slowly."""
    device = next(policy.parameters()).device
    with torch.no_grad():
        cache = policy(input_ids=torch.ones(1, 2, dtype=torch.long, device=device),
                       use_cache=True).cache
    if not fork.forkable(cache) and parallel.rank() == 0:
        kinds = sorted({type(layer).__name__ for layer in getattr(cache, "layers", [cache])})
        what = "MC values and sampling" if cfg.algo == "vineppo" else "sampling"
        tqdm.write(f"--model {cfg.model}: its KV cache ({', '.join(kinds)}) cannot be forked: "
                   f"{what} encode each state's prefix afresh (the same values, slower)")


def go_offline_without_hub(cfg):
    """Offline, the hub libraries retry each file for ~25 s before they fail: one quick look at the
    hub first, and if it cannot be reached they run offline (cached files only, a missing one fails
    at once)."""
    from huggingface_hub import constants, get_session
    model = ALIASES.get(cfg.model, cfg.model)
    needs_hub = ((model != "tiny" and not os.path.exists(model))
                 or {"gsm8k", "math"} & {cfg.data, cfg.eval_data})
    if not needs_hub or constants.HF_HUB_OFFLINE:
        return
    try:
        get_session().head(constants.ENDPOINT, timeout=5)
    except Exception as e:
        # no network, no name resolution, a firewall: offline mode, as if HF_HUB_OFFLINE=1
        # read by transformers at each call, by datasets when imported
        constants.HF_HUB_OFFLINE = True
        tqdm.write(f"the hub ({constants.ENDPOINT}) cannot be reached ({first_line(e)}): "
                   "cached files only")
