"""`shardwise serve`'s pure pieces, without processes or a model: where a completion's text ends and why, what a
request may ask for, which queued prompts share a batch, and the command line's checks."""

from __future__ import annotations

import socket
import subprocess
import sys
from concurrent.futures import Future

import pytest
from pydantic import ValidationError

from shardwise.inference.serve.batching import (Batch, RequestQueue, Row, Sampling, ShuttingDown, left_padded,
                                                take_batch)
from shardwise.inference.serve.options import ServeOptionError, build_parser, listening_socket, load_options
from shardwise.inference.serve.protocol import (CompletionRequest, Finished, completion_response, cut_at_stop,
                                                finish, unsupported)

CHARS = {i: c for i, c in enumerate("abcdefghij")}
EOS, PAD = 98, 99


def decode(ids: list[int]) -> str:
    return "".join(CHARS.get(i, "") for i in ids)  # special tokens (EOS, PAD) decode to nothing


def test_a_row_ends_at_its_first_end_of_sequence_token_which_is_counted_but_not_shown() -> None:
    # The batch generated 8 tokens; this row ended after 3 and was padded by generate.
    assert finish([0, 1, 2, EOS, PAD, PAD, PAD, PAD], decode, frozenset({EOS}), 8, ()) == Finished("abc", "stop", 4)


def test_a_row_without_end_token_is_cut_at_its_own_max_tokens() -> None:
    # Its batch mate asked for 6 tokens; this request asked for 4.
    assert finish([0, 1, 2, 3, 4, 5], decode, frozenset({EOS}), 4, ()) == Finished("abcd", "length", 4)
    # An end token past max_tokens is not this request's.
    assert finish([0, 1, EOS], decode, frozenset({EOS}), 2, ()) == Finished("ab", "length", 2)


def test_a_stop_string_cuts_the_text_before_its_first_occurrence() -> None:
    # "cd" is complete after the 4th token: 4 tokens counted, the text ends before "cd".
    assert finish([0, 1, 2, 3, 4, 2, 3], decode, frozenset({EOS}), 7, ("cd",)) == Finished("ab", "stop", 4)
    # The earliest of several stop strings wins, whichever is listed first.
    assert finish([0, 1, 2, 3, 4], decode, frozenset({EOS}), 5, ("de", "bc")) == Finished("a", "stop", 3)
    # A stop string that never appears changes nothing.
    assert finish([0, 1, 2], decode, frozenset({EOS}), 3, ("zz",)) == Finished("abc", "length", 3)
    assert cut_at_stop("hello world", ("o",)) == "hell" and cut_at_stop("hello", ("x",)) is None


def test_fields_shardwise_does_not_implement_are_refused_by_name() -> None:
    def refusal(**fields: object) -> tuple[str, str] | None:
        return unsupported(CompletionRequest(prompt="hi", **fields))

    assert refusal() is None and refusal(n=1, stream=False, echo=False, user="me", best_of=1) is None
    assert refusal(n=2) == ("n", "n: shardwise serve returns one completion per prompt; send the request n times "
                                 "(with different seeds) for several samples; got 2.")
    assert refusal(stream=True) == ("stream", "stream: streaming responses are not supported by shardwise serve; "
                                              "send stream=false (the default) to get the whole completion in one "
                                              "response; got true.")
    assert refusal(echo=True)[0] == "echo" and refusal(logprobs=2)[0] == "logprobs"
    assert refusal(presence_penalty=0.5)[1].endswith("got 0.5.")
    assert refusal(stop=["ok", ""]) == ("stop", 'stop: an empty string would end every completion before it '
                                                'starts; got "". Remove it.')
    assert unsupported(CompletionRequest(prompt=[])) == ("prompt", "prompt: at least one prompt is needed; got an "
                                                                   "empty list.")


def test_wrong_types_and_unknown_keys_fail_validation() -> None:
    for body in ({"prompt": 3}, {"prompt": "hi", "max_tokens": 0}, {"prompt": "hi", "temperature": -1},
                 {"prompt": "hi", "top_k": 5}, {}):
        with pytest.raises(ValidationError):
            CompletionRequest.model_validate(body)
    request = CompletionRequest(prompt=["a", "b"], stop="x")
    assert (request.prompts, request.stops, request.max_tokens, request.temperature) == (["a", "b"], ("x",), 16, 1.0)


def test_the_response_has_openai_shape_and_sums_usage_over_prompts() -> None:
    body = completion_response("tiny", [5, 7], [Finished("ab", "stop", 3), Finished("cd", "length", 4)])
    dumped = body.model_dump()
    assert dumped["id"].startswith("cmpl-") and dumped["object"] == "text_completion" and dumped["model"] == "tiny"
    assert dumped["choices"] == [{"index": 0, "text": "ab", "finish_reason": "stop", "logprobs": None},
                                 {"index": 1, "text": "cd", "finish_reason": "length", "logprobs": None}]
    assert dumped["usage"] == {"prompt_tokens": 12, "completion_tokens": 7, "total_tokens": 19}


def _row(length: int, max_tokens: int = 4, temperature: float = 0.0, seed: int | None = None) -> Row:
    return Row(list(range(1, length + 1)), max_tokens, Sampling(temperature, 1.0, seed))


def test_a_batch_takes_the_oldest_row_and_later_ones_that_sample_alike() -> None:
    greedy, hot, greedy2, warm, greedy3 = _row(3), _row(3, temperature=0.7), _row(2), _row(3, temperature=0.5), _row(5)
    pending = [greedy, hot, greedy2, warm, greedy3]
    assert take_batch(pending, 8, 64) == [greedy, greedy2, greedy3]
    assert pending == [hot, warm]  # the others keep their order
    assert take_batch(pending, 8, 64) == [hot] and take_batch(pending, 8, 64) == [warm] and pending == []
    assert take_batch([], 8, 64) == []


def test_a_batch_stops_at_max_batch_size_and_at_the_cache_length() -> None:
    rows = [_row(2) for _ in range(5)]
    pending = list(rows)
    assert take_batch(pending, 3, 64) == rows[:3] and pending == rows[3:]
    # 10 + 20 fits in 32; a 20-token prompt would make it 20 + 20, 23 new tokens 10 + 23: those rows wait.
    first, long_prompt, long_answer = _row(10, 20), _row(20, 4), _row(4, 23)
    pending = [first, long_prompt, long_answer]
    assert take_batch(pending, 8, 32) == [first] and pending == [long_prompt, long_answer]
    assert take_batch(pending, 8, 32) == [long_prompt] and take_batch(pending, 8, 32) == [long_answer]


def test_a_seeded_sampled_row_generates_alone_and_a_seeded_greedy_one_does_not() -> None:
    seeded, other = _row(3, temperature=0.8, seed=7), _row(3, temperature=0.8)
    pending = [seeded, other]
    assert take_batch(pending, 8, 64) == [seeded] and pending == [other]
    pending = [other, _row(3, temperature=0.8, seed=7)]
    assert take_batch(pending, 8, 64) == [other] and len(pending) == 1
    greedy_seeded, greedy = _row(3, seed=7), _row(3)
    assert take_batch([greedy_seeded, greedy], 8, 64) == [greedy_seeded, greedy]


def test_prompts_are_padded_on_the_left_with_a_mask() -> None:
    batch = left_padded([Row([5, 6, 7], 4, Sampling(0.0, 1.0)), Row([8], 9, Sampling(0.0, 1.0))], 0, [2])
    assert batch == Batch([[5, 6, 7], [0, 0, 8]], [[1, 1, 1], [0, 0, 1]], 9, 0, [2], Sampling(0.0, 1.0))


def test_sampling_maps_onto_generate_keywords() -> None:
    assert Sampling(0.0, 0.9).generate_kwargs() == {"do_sample": False}
    # OpenAI's sampling has no top-k cut: Hugging Face's default of 50 is switched off.
    assert Sampling(0.7, 0.9).generate_kwargs() == {"do_sample": True, "temperature": 0.7, "top_p": 0.9, "top_k": 0}


def test_a_closed_queue_refuses_rows_and_hands_back_what_was_waiting() -> None:
    queue, row = RequestQueue(), _row(2)
    queue.submit([row])
    assert queue.close() == [row]
    with pytest.raises(ShuttingDown, match="shutting down"):
        queue.submit([_row(2)])
    assert queue.take(8, 64, timeout=0.0) == [] and isinstance(row.future, Future)


def test_command_line_errors_name_the_option(tmp_path) -> None:
    (tmp_path / "config.json").write_text("{}")

    def options(*extra: str):
        return load_options(build_parser().parse_args(["--model", str(tmp_path), *extra]))

    assert options().served_model_name == tmp_path.name and options("--served_model_name", "x").served_model_name == "x"
    with pytest.raises(ServeOptionError, match=r"^--tp: must be at least 1; got 0\.$"):
        options("--tp", "0")
    with pytest.raises(ServeOptionError, match=r"^--port: must be between 0 and 65535; got 70000\.$"):
        options("--port", "70000")
    with pytest.raises(ServeOptionError, match="no config.json there"):
        load_options(build_parser().parse_args(["--model", str(tmp_path / "missing")]))
    with pytest.raises(ServeOptionError, match="--adapter .*: no such file or folder"):
        options("--adapter", str(tmp_path / "nope"))


def test_a_taken_port_is_refused_before_anything_starts() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ServeOptionError, match=rf"^--host 127.0.0.1 --port {port}: cannot listen there"):
            listening_socket("127.0.0.1", port)


def test_the_agent_leaves_sigterm_and_sigint_to_serve_when_asked() -> None:
    from shardwise.launcher import local

    plan = local.LocalLaunch(nproc=2, script="m", module=True)
    assert local.torchrun_args(plan).signals_to_handle == "SIGTERM,SIGINT,SIGHUP,SIGQUIT"  # torch's default
    assert local.torchrun_args(local.LocalLaunch(nproc=2, script="m", module=True, agent_signals="SIGHUP,SIGQUIT")
                               ).signals_to_handle == "SIGHUP,SIGQUIT"


def test_the_launcher_lists_serve_and_loads_neither_torch_nor_fastapi_for_it() -> None:
    code = ("import sys, shardwise.cli as c; assert 'serve' in c.SUBCOMMANDS; "
            "print(sorted(m for m in ('torch', 'fastapi', 'uvicorn') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
