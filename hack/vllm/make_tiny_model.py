"""Make the suite's tiny model: a random-weight ``LlamaForCausalLM`` and a byte-level BPE tokenizer
with a chat template, saved as a local Hugging Face folder that vLLM serves with no model hub.

Usage (what ``make vllm`` runs, with the engine's own interpreter)::

    <engine venv>/bin/python hack/vllm/make_tiny_model.py DEST

Everything is seeded (:data:`SEED`): the tokenizer is trained on a corpus generated here from a
fixed word list, the weights are ``torch.manual_seed(SEED)``'s initialisation, so the same pins
make the same files. The shape (:data:`SHAPE`) is chosen for vLLM's CPU attention: head size 64
(a size its kernels support), 2 KV heads (grouped-query attention as real models have), 4 layers,
``max_position_embeddings`` 4096 (the suite's ``--max-model-len``); ~3.7 M parameters, ~8 MB in
bfloat16. What it generates is noise; what matters to tokenfair is that it is a real model served
by the real engine: real tokenization, prefill, decode, KV blocks, batching and usage.

DEST is filled in a sibling ``.partial`` folder and renamed into place at the end; if DEST
exists already the script does nothing.
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
from pathlib import Path

SEED = 20270027
VOCAB_SIZE = 2048
SHAPE = {
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,  # head size 256 / 4 = 64
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
}
BOS, EOS, PAD = "<s>", "</s>", "<pad>"
# Role markers are ordinary text to the tokenizer: the template is what a chat model's is for.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
CORPUS_TEXT = (
    "the a an of to in is are was be for on with as by at from this that it and or not "
    "request tenant token tokens batch queue server model prompt answer stream budget share "
    "fair admission schedule latency service cache block decode prefill user assistant system "
    "hello world code summary document extract repository function class return value error "
    "time second minute hour day first last next many few more less every each some none "
    "interactive completion chat embed policy quota weight deficit round robin lane priority"
)
CORPUS_LINES = 4000


def corpus(seed: int) -> list[str]:
    """Deterministic pseudo-English lines (words, digits, punctuation) to train the BPE on."""
    rng = random.Random(seed)
    words_known = CORPUS_TEXT.split()
    lines = []
    for _ in range(CORPUS_LINES):
        words = [rng.choice(words_known) for _ in range(rng.randint(4, 16))]
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 9999)))
        lines.append(" ".join(words).capitalize() + rng.choice(".?!,:;"))
    return lines


def make_tokenizer(dest: Path) -> dict[str, int]:
    """Train and save the tokenizer (``tokenizer.json`` and its config); return the special
    tokens' ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus(SEED), trainer=trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        model_max_length=SHAPE["max_position_embeddings"],
    )
    wrapped.chat_template = CHAT_TEMPLATE
    wrapped.save_pretrained(dest)
    return {name: tokenizer.token_to_id(token) for name, token in
            (("bos", BOS), ("eos", EOS), ("pad", PAD))}  # fmt: skip


def make_model(dest: Path, special_ids: dict[str, int]) -> None:
    """Initialise the Llama with :data:`SEED` and save it (safetensors, bfloat16)."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        bos_token_id=special_ids["bos"],
        eos_token_id=special_ids["eos"],
        pad_token_id=special_ids["pad"],
        tie_word_embeddings=False,
        rms_norm_eps=1e-5,
        dtype="bfloat16",
        **SHAPE,
    )
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(dest, safe_serialization=True)
    GenerationConfig(
        bos_token_id=special_ids["bos"],
        eos_token_id=special_ids["eos"],
        pad_token_id=special_ids["pad"],
    ).save_pretrained(dest)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dest", type=Path, help="the model folder to create")
    args = parser.parse_args(argv)
    dest: Path = args.dest
    if dest.exists():
        return 0
    partial = dest.with_name(dest.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    make_model(partial, make_tokenizer(partial))
    partial.rename(dest)
    size_mb = sum(p.stat().st_size for p in dest.iterdir()) / 1e6
    print(f"tiny model: {dest} ({size_mb:.1f} MB)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
