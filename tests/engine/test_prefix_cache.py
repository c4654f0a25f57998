from vlmq.workers.engine import EngineConfig, ImagePlaceholder, SamplingParams, Scheduler, Sequence, SequenceStatus
from vlmq.workers.engine.block_hash import ROOT_HASH, hash_block, image_extra_keys, seq_block_hashes
from vlmq.workers.engine.testing import FakeRunner, check_step, reference_completion, run_until_done

SYSTEM = list(range(100, 110))  # 10 tokens of system prompt
PAD = 7  # every image token has the same id, whatever the image
IMG_TOKENS = 12


def request(seq_id, image_key, question, max_new_tokens=4):
    prompt = SYSTEM + [PAD] * IMG_TOKENS + question  # image occupies [10, 22)
    img = ImagePlaceholder(image_key, len(SYSTEM), IMG_TOKENS, 4 * IMG_TOKENS)
    return Sequence(seq_id, prompt, images=(img,), sampling=SamplingParams(max_new_tokens=max_new_tokens))


def engine(**overrides):
    cfg = EngineConfig(**{"block_size": 4, "num_blocks": 64, "max_num_batched_tokens": 64,
                          "long_prefill_chunk_size": 64, "max_num_encoder_patches": 96,
                          "encoder_cache_bytes": 10_000, "encoder_bytes_per_token": 10, **overrides})
    sched = Scheduler(cfg)
    return sched, FakeRunner(cfg.block_size, sched.encoder_cache)


def serve(sched, runner, seq):
    outs = []
    sched.add(seq)
    done = run_until_done(sched, runner, on_step=lambda out: (check_step(sched, out), outs.append(out)))
    assert done[seq.seq_id] == reference_completion(seq)  # shared KV must be exactly the KV it would compute
    return outs


def test_block_hash_is_chained_and_image_aware():
    h0 = hash_block(ROOT_HASH, [1, 2, 3, 4])
    assert h0 == hash_block(ROOT_HASH, [1, 2, 3, 4]) and len(h0) == 32
    assert hash_block(h0, [5, 6]) != hash_block(ROOT_HASH, [5, 6])
    assert hash_block(ROOT_HASH, [PAD] * 4, [("cat", 0)]) != hash_block(ROOT_HASH, [PAD] * 4, [("dog", 0)])
    assert hash_block(ROOT_HASH, [PAD] * 4, [("cat", 0)]) != hash_block(ROOT_HASH, [PAD] * 4, [("cat", 4)])
    assert hash_block(ROOT_HASH, [PAD] * 4) != hash_block(ROOT_HASH, [PAD] * 4, [("cat", 0)])


def test_extra_keys_name_every_overlapping_image_with_its_offset():
    img = ImagePlaceholder("cat", 10, 12, 48)
    assert image_extra_keys([img], 8, 12) == (("cat", -2),)  # block starts 2 tokens before the image
    assert image_extra_keys([img], 16, 20) == (("cat", 6),)
    assert image_extra_keys([img], 4, 8) == () and image_extra_keys([img], 24, 28) == ()


def test_same_text_different_images_hash_differently_from_the_first_image_block():
    cat, dog = request(0, "cat", [1, 2]), request(1, "dog", [1, 2])
    assert cat.token_ids == dog.token_ids
    hc, hd = seq_block_hashes(cat, 4, 6), seq_block_hashes(dog, 4, 6)
    assert hc[:2] == hd[:2]  # blocks [0, 8): system prompt only
    assert all(a != b for a, b in zip(hc[2:], hd[2:], strict=True))  # block [8, 12) already holds image tokens


def test_same_system_prompt_and_image_reuses_full_blocks():
    sched, runner = engine()
    serve(sched, runner, request(0, "cat", [1, 2, 3]))
    outs = serve(sched, runner, request(1, "cat", [4, 5, 6]))
    first = outs[0].scheduled[0]
    assert first.num_cached_tokens == 20  # 5 full blocks: system prompt + 10 of 12 image tokens
    assert outs[0].num_prefix_cached_tokens == 20 and first.start == 20
    # The cached prefix ends inside the image, so its encoder output is needed: a hit, not a re-encode.
    assert outs[0].encoder_inputs == [] and outs[0].num_encoder_cache_hits == 1
    assert sched.block_manager.num_prefix_hits == 20


def test_same_tokens_different_image_misses_after_the_text_prefix():
    sched, runner = engine()
    serve(sched, runner, request(0, "cat", [1, 2, 3]))
    outs = serve(sched, runner, request(1, "dog", [1, 2, 3]))
    assert outs[0].scheduled[0].num_cached_tokens == 8  # only the blocks before the image are shared
    assert [e.key for e in outs[0].encoder_inputs] == ["dog"]


def test_prefix_caching_disabled_never_hits():
    sched, runner = engine(enable_prefix_caching=False)
    serve(sched, runner, request(0, "cat", [1, 2, 3]))
    outs = serve(sched, runner, request(1, "cat", [1, 2, 3]))
    assert outs[0].num_prefix_cached_tokens == 0 and sched.block_manager.num_prefix_hits == 0


def test_running_requests_share_blocks_and_cached_blocks_get_evicted_under_pressure():
    sched, runner = engine(num_blocks=12)
    sched.add(request(0, "cat", [1]))
    run_until_done(sched, runner)
    assert len(sched.block_manager.hash_to_block) == 6  # 26 tokens with KV: the decode blocks count too
    a, b = request(1, "cat", [2], max_new_tokens=20), request(2, "cat", [3], max_new_tokens=20)
    sched.add(a)
    sched.add(b)  # held back while a, the image's leader, computes it (admission.py)
    assert sched.admission.held == [b]
    out = sched.schedule()
    assert [(s.seq, s.num_cached_tokens) for s in out.scheduled] == [(a, 20)]
    while b not in sched.running:
        sched.update(runner.execute(out))
        out = sched.schedule()
    assert [(s.seq, s.num_cached_tokens) for s in out.scheduled if s.seq is b] == [(b, 20)]
    assert a.block_table[:5] == b.block_table[:5]
    assert all(sched.block_manager.ref_counts[x] == 2 for x in a.block_table[:5])
    sched.update(runner.execute(out))
    done = run_until_done(sched, runner, on_step=lambda o: check_step(sched, o))
    assert done == {1: reference_completion(a), 2: reference_completion(b)}
    # Two more 20-token-chained requests with a different image fill all 12 blocks: the cat blocks go.
    for i, key in ((3, "dog"), (4, "owl")):
        serve(sched, runner, request(i, key, [1], max_new_tokens=20))
    outs = serve(sched, runner, request(5, "cat", [1]))
    assert outs[0].scheduled[0].num_cached_tokens < 20


# -- deferred admission (admission.py): a request whose image another request is still prefilling waits for that
# KV instead of recomputing it; held requests can be aborted; a leader that goes away releases them.
CHUNKED = {"max_num_batched_tokens": 16, "long_prefill_chunk_size": 8}  # the leader needs steps to pass the image


def test_a_follower_waits_for_its_leaders_image_then_reuses_its_kv():
    sched, runner = engine(**CHUNKED)
    leader, follower, other = request(0, "cat", [1, 2]), request(1, "cat", [3]), request(2, "dog", [4])
    for seq in (leader, follower, other):
        sched.add(seq)
    assert sched.admission.held == [follower] and sched.admission.num_deferred == 1
    admitted = {}

    def watch(out):
        check_step(sched, out)
        for s in out.scheduled:
            admitted.setdefault(s.seq_id, (out.step, s.num_cached_tokens))
        if follower in sched.waiting or follower in sched.running:  # released only once the image is computed
            assert leader.num_computed_tokens >= len(SYSTEM) + IMG_TOKENS or leader.is_finished

    done = run_until_done(sched, runner, on_step=watch)
    assert done == {s.seq_id: reference_completion(s) for s in (leader, follower, other)}
    assert admitted[1][0] > admitted[0][0] and admitted[1][1] >= 20  # the image's full blocks came from the cache
    assert admitted[2][0] == 0  # a request with another image is never held
    assert sched.admission.held == [] and sched.admission.leaders == {}


def test_aborting_a_held_request_reports_it_and_leaves_the_leader_running():
    sched, runner = engine(**CHUNKED)
    leader, follower = request(0, "cat", [1]), request(1, "cat", [2])
    sched.add(leader)
    sched.add(follower)
    assert sched.abort(1) is follower and follower.status is SequenceStatus.FINISHED_ABORTED
    assert sched.abort(1) is None and sched.admission.held == []
    out = sched.schedule()
    assert out.finished_seq_ids == [1] and [s.seq_id for s in out.scheduled] == [0]
    sched.update(runner.execute(out))
    assert run_until_done(sched, runner) == {0: reference_completion(leader)}


def test_a_leader_that_goes_away_releases_its_followers():
    sched, runner = engine(**CHUNKED)
    leader, a, b = request(0, "cat", [1]), request(1, "cat", [2]), request(2, "cat", [3])
    for seq in (leader, a, b):
        sched.add(seq)
    sched.update(runner.execute(sched.schedule()))  # the leader computed part of the image
    assert sched.abort(0) is leader
    out = sched.schedule()
    # a leads now and b follows it: only one of them computes the image again
    assert [s.seq for s in out.scheduled] == [a] and sched.admission.held == [b]
    sched.update(runner.execute(out))
    assert run_until_done(sched, runner) == {1: reference_completion(a), 2: reference_completion(b)}
    assert sched.admission.num_deferred == 2  # counted once each, however long they waited


def test_without_the_prefix_cache_nothing_is_held():
    sched, _ = engine(enable_prefix_caching=False)
    sched.add(request(0, "cat", [1]))
    sched.add(request(1, "cat", [2]))
    assert sched.admission.held == [] and len(sched.waiting) == 2
