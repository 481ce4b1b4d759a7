"""Several requests at once on the real default model: one forward pass serves every active
request, and each output is what that request gives alone (greedy: checked at every position
against plain decoding, up to the rounding noise measured in the same run)."""

from __future__ import annotations

import threading

import pytest
from text_data import edit_prompt

from srsd_local.bench.workloads import first_per_category, load_workload
from srsd_local.engine import Engine

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def four(model_path):
    eng = Engine.load(model_path, n_ctx=2048, parallel=4, learned=False)
    yield eng
    eng.close()


def _requests() -> list[dict]:
    ps = {p.category: p.prompt for p in first_per_category(load_workload("all"), 1)}
    return [
        {"prompt": edit_prompt(), "mode": "srsd", "max_tokens": 96},
        {"prompt": ps["code_edit"], "mode": "ngram", "max_tokens": 64, "stop": ["\n\n\n"]},
        {"prompt": ps["humaneval"], "mode": "ar", "max_tokens": 48},
        {"prompt": ps["text_edit"], "mode": "retrieval", "max_tokens": 80},
        {"prompt": ps["code_continue"], "mode": "hybrid", "max_tokens": 32},
        {"prompt": ps["open"], "mode": "srsd", "max_tokens": 40, "temperature": 0.8,
         "seed": 11},
    ]


def test_concurrent_requests_equal_plain_decoding_at_every_position(four):
    reqs = _requests()
    outs = four.generate_many(reqs)
    assert four.parallel == 4 and not any(s.busy for s in four.slots)
    for r, out in zip(reqs, outs):
        assert 0 < len(out.token_ids) <= r["max_tokens"]
        if r.get("temperature"):
            continue
        rep = four.verify_output(r["prompt"], out.token_ids)
        assert rep.ok, (r["mode"], rep.summary())
        if "stop" not in r and out.finish_reason == "length":
            assert len(out.token_ids) == r["max_tokens"]
    assert sum(o.stats.accepted_tokens for o in outs) > 0  # speculation ran in the batches
    # the sampled request: its first token was drawn from the prompt's distribution. Its
    # logits came from a batch shared with other prompts, so they carry rounding noise and
    # the draw need not repeat alone (the distribution itself is tested in test_correctness);
    # here: the drawn token is a plausible draw, not far below plain decoding's best
    sampled = [o for r, o in zip(reqs, outs) if r.get("temperature")][0]
    assert len(sampled.token_ids) == reqs[-1]["max_tokens"] or sampled.finish_reason == "stop"
    rep = four.verify_output(reqs[-1]["prompt"], sampled.token_ids[:1])
    assert not rep.gaps or rep.gaps[0] < 8.0  # p >= e^(-8 / 0.8) of the best token's


def test_submit_from_threads_with_a_cancellation(four):
    reqs = _requests()[:3]
    results: dict[int, list[int]] = {}

    def run(i: int) -> None:
        ids: list[int] = []
        for ev in four.submit(**reqs[i]):
            ids += ev.token_ids
        results[i] = ids

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    it = four.submit(prompt=edit_prompt(), max_tokens=500, mode="srsd")
    next(it)
    it.close()  # cancelled after its first event: its slot is freed within a step
    for t in threads:
        t.join(timeout=300)
    assert sorted(results) == [0, 1, 2]
    for i, r in enumerate(reqs):
        rep = four.verify_output(r["prompt"], results[i])
        assert rep.ok, (r["mode"], rep.summary())
    assert not any(s.busy for s in four.slots)


def test_verification_measures_rounding_with_another_sequences_cells_interleaved(four):
    # with several slots the check also decodes the context again with another sequence's
    # cells between its own (as concurrent requests lay them out): the rows stay the
    # context's own (a few logits of drift at most: a wrong position or a visible foreign
    # cell would move them far more) and the noise covers that layout too
    from srsd_local.engine.verify import verify_tokens

    prompt = _requests()[2]["prompt"]
    out = four.generate(prompt, max_tokens=40, mode="ar")
    with four._lock:
        alone = verify_tokens(four, prompt, out.token_ids)
        both = verify_tokens(four, prompt, out.token_ids, interleave=True)
    assert alone.ok and both.ok and both.positions == alone.positions == 40
    assert both.noise >= alone.noise and both.drift < 3.0
    # ... and the interleaved rows were measured as a layout of their own: they differ from
    # one-token decoding's and from the plain batches of the same size (whether they set
    # the largest drift or noise of the check depends on the machine's kernels)
    lay = both.drift_by_layout
    assert set(alone.drift_by_layout) == {"4", "8", "16", "32"}
    assert set(lay) == {"4", "8", "16", "32", "interleaved"}
    assert both.drift == max(lay.values()) and alone.drift == max(alone.drift_by_layout.values())
    assert 0.0 < lay["interleaved"] != lay["16"], lay
    assert four.verify_output(prompt, out.token_ids).noise == both.noise
