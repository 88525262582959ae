"""llama.cpp as a `bench e2e` peer: the GGUF files made for a run (without llama.cpp: the converter's
vocabulary step and the conversion's bookkeeping), and the peer itself where scripts/peers.sh built
it (CI does not: the build takes ~15 min)."""

import json
import subprocess
import sys

import pytest

from moeshard.bench import peers
from moeshard.bench.peer_llamacpp import NORMAL_TOKEN, with_plain_vocab
from moeshard.cli import main


class RecordingWriter:
    """The few GGUFWriter methods a vocabulary step calls, recorded."""

    def __init__(self):
        self.fields = {}

    def __getattr__(self, name):
        return lambda value: self.fields.__setitem__(name, value)


class RefusingConverter:
    """A stand-in for a class of llama.cpp's converter: its subclasses must name their architecture in
    their own body (ModelBase.__init_subclass__), and its own vocabulary step refuses a tokenizer it
    does not know, as the real one does for the random checkpoint's."""

    model_arch = "qwen3moe"

    def __init_subclass__(cls):
        if "model_arch" not in cls.__dict__:
            raise TypeError(f"Missing property 'model_arch' for {cls.__name__!r}")

    def __init__(self, vocab_size):
        self.hparams, self.gguf_writer = {"vocab_size": vocab_size}, RecordingWriter()

    def set_vocab(self):
        raise NotImplementedError("BPE pre-tokenizer was not recognized")


def test_plain_vocab_is_one_distinct_token_per_embedding_row():
    model = with_plain_vocab(RefusingConverter)(4099)  # an odd size: the list follows the embedding, not a round number
    model.set_vocab()
    fields = model.gguf_writer.fields
    assert fields["add_tokenizer_model"] == "llama"
    tokens = fields["add_token_list"]
    assert len(tokens) == 4099 and len(set(tokens)) == 4099  # llama.cpp finds a token by its text
    assert fields["add_token_scores"] == [0.0] * 4099 and fields["add_token_types"] == [NORMAL_TOKEN] * 4099


def fake_peer(log_path):
    """A peer command that writes its output file (its last argument) and logs its arguments; a step
    whose input is named `broken` fails."""
    script = ("import sys, pathlib; open(sys.argv[1], 'a').write(' '.join(sys.argv[2:]) + chr(10)); "
              "sys.exit('broken input') if 'broken' in sys.argv[-2] else pathlib.Path(sys.argv[-1]).write_text('gguf')")
    return lambda *args: [sys.executable, "-c", script, str(log_path), *args]


def test_gguf_files_convert_once_beside_the_checkpoint_and_quantize_from_bf16(tmp_path, monkeypatch):
    calls = tmp_path / "calls"
    monkeypatch.setattr(peers, "peer_llamacpp", fake_peer(calls))
    checkpoint = str(tmp_path / "model")
    files = peers.gguf_files(checkpoint, ["q4_0", "bf16"], 2, tmp_path / "convert.log")
    assert files == {"q4_0": tmp_path / "model-q4_0.gguf", "bf16": tmp_path / "model-bf16.gguf"}
    assert all(path.read_text() == "gguf" for path in files.values())
    bf16 = tmp_path / "model-bf16.gguf"
    assert calls.read_text().splitlines() == [
        f"convert {peers.LLAMA_CPP_SOURCE} {checkpoint} {bf16.with_suffix('.partial')}",
        f"quantize {bf16} q4_0 2 {tmp_path / 'model-q4_0.partial'}",
    ]
    # a second run's request: only the format not made yet
    peers.gguf_files(checkpoint, ["bf16", "q4_0", "q8_0"], 2, tmp_path / "convert.log")
    assert calls.read_text().splitlines()[2:] == [f"quantize {bf16} q8_0 2 {tmp_path / 'model-q8_0.partial'}"]


def test_a_failed_conversion_leaves_no_file_that_looks_finished(tmp_path, monkeypatch):
    monkeypatch.setattr(peers, "peer_llamacpp", fake_peer(tmp_path / "calls"))
    with pytest.raises(RuntimeError, match="llama.cpp's convert to broken-bf16.gguf failed:\nbroken input"):
        peers.gguf_files(str(tmp_path / "broken"), ["q8_0"], 1, tmp_path / "convert.log")
    assert not list(tmp_path.glob("*.gguf"))


@pytest.mark.parametrize("flags, error", [
    (["--llama-formats", "q4_0,q3_k"], "--llama-formats takes bf16, q8_0, q4_0, q4_k_m, got q3_k."),
    (["--dtype", "float32"], "llama.cpp serves bf16 and quantized GGUFs, never this run's float32"),
])
def test_bench_e2e_against_llamacpp_refuses_bad_settings_before_writing_a_model(flags, error, capsys):
    assert main(["bench", "e2e", "--against", "llama.cpp", *flags]) == 2
    assert error in capsys.readouterr().out


def llamacpp_missing() -> str | None:
    try:
        peers.llamacpp_python(need_server=True)
    except RuntimeError as e:
        return str(e)
    return None


@pytest.mark.skipif(llamacpp_missing() is not None, reason=f"{llamacpp_missing()} (CI does not build it: ~15 min)")
def test_bench_e2e_against_llamacpp_runs_each_format_at_one_and_more_sequences(tmp_path):
    out = tmp_path / "e2e.json"
    proc = subprocess.run(
        [sys.executable, "-m", "moeshard", "bench", "e2e", "--against", "llama.cpp", "--llama-formats", "bf16,q4_0",
         "--quantization", "bf16,int4", "--concurrency", "1,2", "--threads", "1", "--num-requests", "3", "--prompt-lens", "4", "9",
         "--output-lens", "6", "6", "--repeats", "1", "--json", str(out)],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    rows = {(r["concurrency"], r["contender"]): r for r in result["rows"]}
    assert set(rows) == {(c, name) for c in (1, 2)
                         for name in ("moeshard bf16", "moeshard int4", "llama.cpp bf16", "llama.cpp q4_0")}
    # the same bits a weight side by side, and int4 against moeshard's own bf16
    assert [(p["concurrency"], p["first"], p["second"]) for p in result["pairs"]] == [
        (c, first, second) for c in (1, 2) for first, second in (
            ("moeshard bf16", "llama.cpp bf16"), ("moeshard int4", "llama.cpp q4_0"), ("moeshard int4", "moeshard bf16"))]
    # bf16 against bf16: the same weights, rounded differently; a wrong conversion (a transposed or
    # misnamed tensor) would agree on next to nothing
    assert rows[1, "llama.cpp bf16"]["same_tokens"] >= 0.5 and rows[2, "llama.cpp bf16"]["same_tokens"] >= 0.5
    assert all(r["prefill_tok_s"] > 0 for (c, _), r in rows.items() if c == 1)
    assert all(r["prefill_tok_s"] is None for (c, _), r in rows.items() if c == 2)
