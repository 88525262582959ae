"""llama.cpp as a `bench e2e` contender, run by the peer's own Python (`.peers/llamacpp`,
scripts/peers.sh): it imports llama-cpp-python and llama.cpp's converter, never moeshard.

    convert LLAMA_CPP_DIR CHECKPOINT OUT.gguf      the checkpoint to a bf16 GGUF, by llama.cpp's converter
    quantize IN.gguf TYPE THREADS OUT.gguf        llama_model_quantize (TYPE: q8_0, q4_0, q4_k_m)
    generate MODEL.gguf THREADS CONTEXT           one sequence at a time through `Llama`, on token ids:

    in:  {"prompts": [[ids…], …], "outputs": [n, …]}
    out: {"tokens": [[ids…], …], "seconds": s, "prefill_seconds": p}

Greedy, EOS ignored, exactly n tokens each; `seconds` is the whole workload, `prefill_seconds` the
sum of the prompts' times to their first token. Every prompt starts from an empty KV cache (the
workload repeats its prompts, and `Llama.generate` would reuse a cached prefix).

The benchmark's checkpoints are random weights without a tokenizer: llama.cpp's converter knows a
vocabulary only by its tokenizer's pre-tokenizer hash and BPE merges, so its vocabulary step is
replaced by a plain token list (`write_plain_vocab`); the engine is fed token ids and never reads it.
"""

import json
import sys
import time

REPLY = "moeshard-peer "  # llama.cpp logs on stderr, but a reply stays recognisable on stdout anyway
NORMAL_TOKEN = 1  # gguf.TokenType.NORMAL


def write_plain_vocab(writer, vocab_size: int) -> None:
    """One token per id, named by its id, as a SentencePiece ("llama") vocabulary with scores 0:
    llama.cpp looks tokens up by their text, so every name is distinct, and the list is exactly as
    long as the embedding has rows."""
    writer.add_tokenizer_model("llama")
    writer.add_token_list([f"<id{i}>".encode() for i in range(vocab_size)])
    writer.add_token_scores([0.0] * vocab_size)
    writer.add_token_types([NORMAL_TOKEN] * vocab_size)


def with_plain_vocab(model_class):
    """`model_class` (a converter's class) writing the plain vocabulary instead of reading a tokenizer."""

    def set_vocab(self):
        write_plain_vocab(self.gguf_writer, self.hparams["vocab_size"])

    # the converter's classes must name their architecture in their own body
    return type(model_class.__name__, (model_class,), {"model_arch": model_class.model_arch, "set_vocab": set_vocab})


def convert(llama_cpp_dir: str, checkpoint: str, out: str) -> None:
    sys.path[:0] = [llama_cpp_dir, f"{llama_cpp_dir}/gguf-py"]
    import convert_hf_to_gguf as converter

    find = converter.get_model_class
    converter.get_model_class = lambda *args, **kwargs: with_plain_vocab(find(*args, **kwargs))
    sys.argv = ["convert_hf_to_gguf.py", checkpoint, "--outfile", out, "--outtype", "bf16"]
    converter.main()


QUANT_TYPES = {"q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0", "q4_k_m": "LLAMA_FTYPE_MOSTLY_Q4_K_M"}


def quantize(source: str, kind: str, threads: int, out: str) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, QUANT_TYPES[kind])
    params.nthread = threads
    if llama_cpp.llama_model_quantize(source.encode(), out.encode(), params) != 0:
        raise SystemExit(f"llama_model_quantize failed to make {kind} from {source}.")


def generate(model: str, threads: int, context: int) -> None:
    from llama_cpp import Llama

    llm = Llama(model, n_ctx=context, n_batch=min(context, 2048), n_threads=threads, n_threads_batch=threads,
                seed=0, verbose=False)

    def one(prompt: list[int], n: int) -> tuple[list[int], float]:
        llm.reset()  # n_tokens = 0: no prefix of the last sequence is reused
        start, tokens, first = time.perf_counter(), [], 0.0
        for token in llm.generate(prompt, temp=0.0, repeat_penalty=1.0, reset=True):
            if not tokens:
                first = time.perf_counter() - start
            tokens.append(token)
            if len(tokens) == n:
                break
        return tokens, first

    one([1, 2, 3], 2)  # warm-up
    print(REPLY + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        tokens, prefill_seconds, start = [], 0.0, time.perf_counter()
        for prompt, n in zip(command["prompts"], command["outputs"]):
            got, first = one(prompt, n)
            tokens.append(got)
            prefill_seconds += first
        seconds = time.perf_counter() - start
        print(REPLY + json.dumps({"tokens": tokens, "seconds": seconds, "prefill_seconds": prefill_seconds}), flush=True)


def main() -> None:
    command, args = sys.argv[1], sys.argv[2:]
    if command == "convert":
        convert(*args)
    elif command == "quantize":
        quantize(args[0], args[1], int(args[2]), args[3])
    elif command == "generate":
        generate(args[0], int(args[1]), int(args[2]))
    else:
        raise SystemExit(f"unknown command {command!r}: convert, quantize or generate.")


if __name__ == "__main__":
    main()
