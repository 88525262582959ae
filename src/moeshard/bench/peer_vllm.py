"""vLLM as a `bench e2e` contender, run by the peer's own Python (`.peers/vllm`, scripts/peers.sh):
it imports vLLM, never moeshard. One long-lived process per benchmark run (vLLM takes ~40 s to
start): it loads the model once, then serves commands, one JSON line in, one JSON line out.

    in:  {"prompts": [[ids…], …], "outputs": [n, …], "concurrency": c}
    out: {"tokens": [[ids…], …], "seconds": s}

At most c requests are in flight, as in moeshard's `max_concurrency`: a new one is added as soon as
one finishes. Greedy, EOS ignored, exactly n tokens each. Every run starts with an empty prefix cache,
as moeshard's does: the workload repeats its prompts, and neither engine may skip their prefill.
"""

import json
import sys
import time

REPLY = "moeshard-peer "  # vLLM logs on stdout too: replies carry this prefix


def main() -> None:
    model, dtype, max_num_seqs, max_model_len = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    from vllm import LLM, SamplingParams

    llm = LLM(model, dtype=dtype, skip_tokenizer_init=True, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
              max_num_batched_tokens=max(2048, max_model_len), seed=0)
    engine = llm.llm_engine
    print(REPLY + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        prompts, outputs, concurrency = command["prompts"], command["outputs"], command["concurrency"]
        tokens, pending = {}, list(range(len(prompts)))[::-1]
        llm.reset_prefix_cache()
        start = time.perf_counter()
        in_flight = 0
        while len(tokens) < len(prompts):
            while pending and in_flight < concurrency:
                i = pending.pop()
                params = SamplingParams(temperature=0, max_tokens=outputs[i], min_tokens=outputs[i], ignore_eos=True,
                                        detokenize=False)
                engine.add_request(str(i), {"prompt_token_ids": prompts[i]}, params)
                in_flight += 1
            for out in engine.step():
                if out.finished:
                    tokens[int(out.request_id)] = list(out.outputs[0].token_ids)
                    in_flight -= 1
        seconds = time.perf_counter() - start
        print(REPLY + json.dumps({"tokens": [tokens[i] for i in range(len(prompts))], "seconds": seconds}), flush=True)


if __name__ == "__main__":
    main()
