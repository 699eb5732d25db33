"""Online distillation (cloud/learning/distill.py, cloud/learning/lora_gguf.py, cloud/learning/online.py): the top-k
forward KL on literal arrays, training windows, a LoRA that lowers the KL on a tiny random Qwen2 and yields mid-step
without changing anything, the adapter written as llama.cpp's LoRA GGUF computing what peft computes, rounds gated on
the verifier's idleness, per partition, and adapters and their training kept across a restart."""
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

from tandem.cloud.learning.distill import MASKED_LOGPROB, Distiller, Round, topk_forward_kl, windows  # noqa: E402
from tandem.cloud.learning.teacher import Sample, TeacherStore, top_k_logprobs  # noqa: E402

V = 64


def kl(student, ids, logprobs):
    return float(topk_forward_kl(torch.tensor(student, dtype=torch.float32), torch.tensor(ids),
                                 torch.tensor(logprobs, dtype=torch.float32)))


@pytest.mark.parametrize("student, ids, teacher, want", [
    # the student puts the teacher's renormalised probabilities on its k ids and nothing elsewhere: 0
    ([[0.0, 0.0, -1e9, -1e9]], [[0, 1]], [[np.log(0.25), np.log(0.25)]], 0.0),
    # a uniform student over 4 ids against a teacher sure of id 2: log 4
    ([[0.0, 0.0, 0.0, 0.0]], [[2, 0]], [[0.0, -1e9]], np.log(4)),
    # teacher (0.75, 0.25) renormalised from (0.3, 0.1); student uniform over 2 ids: log 2 - H(0.75, 0.25)
    ([[0.0, 0.0]], [[0, 1]], [[np.log(0.3), np.log(0.1)]],
     np.log(2) + 0.75 * np.log(0.75) + 0.25 * np.log(0.25)),
])
def test_the_topk_forward_kl_is_the_kl_to_the_teachers_renormalised_top_k(student, ids, teacher, want):
    assert kl(student, ids, teacher) == pytest.approx(want, abs=1e-5)


def test_the_topk_kl_is_never_negative_and_the_mean_over_positions():
    rng = np.random.default_rng(0)
    student, teacher = rng.standard_normal((5, 10)) * 3, rng.standard_normal((5, 10)) * 3
    ids, lps = top_k_logprobs(teacher.astype(np.float32), 4)
    each = [kl(student[i:i + 1], ids[i:i + 1].astype(np.int64), lps[i:i + 1]) for i in range(5)]
    assert min(each) >= 0
    assert kl(student, ids.astype(np.int64), lps) == pytest.approx(np.mean(each), rel=1e-5)


def sample(tokens, first, k=2, vocab=V):
    """A sample whose teacher says each committed token with probability ~1 (top-1 the token, top-2 the next id)."""
    n = len(tokens) - first
    ids = [np.array([t, (t + 1) % vocab], np.int32) for t in tokens[first:]]
    return Sample(list(tokens), first, ids, [np.array([0.0, -20.0], np.float32)] * n)


def test_windows_point_each_teacher_row_at_the_logits_of_the_token_before_it():
    s = sample(list(range(10, 30)), first=5)  # positions 5..19
    wins = windows([s], max_tokens=8, n_vocab=V)
    assert sum(w.positions for w in wins) == 15
    for w in wins:
        assert len(w.tokens) <= 8
        # the logits at row r predict tokens[r + 1], which the teacher's top-1 names
        for r, ids in zip(w.rows, w.top_ids):
            assert w.tokens[r] + 1 == ids[0]


def test_teacher_ids_past_the_students_vocabulary_get_no_weight():
    s = Sample([1, 2, 3], 1, [np.array([70, 2], np.int32), np.array([3, 90], np.int32)],
               [np.array([-0.1, -2.0], np.float32)] * 2)
    [w] = windows([s], max_tokens=8, n_vocab=V)
    assert w.top_ids.max() < V
    assert w.top_logprobs[0, 0] == MASKED_LOGPROB and w.top_logprobs[1, 1] == MASKED_LOGPROB
    assert w.top_logprobs[0, 1] == pytest.approx(-2.0)


def tiny_qwen2(seed=0, sharpness=4.0):
    """A random Qwen2 with its head sharpened (a few likely ids per position, as a language model has)."""
    torch.manual_seed(seed)
    cfg = transformers.Qwen2Config(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   eos_token_id=V - 1, bos_token_id=None, pad_token_id=None,
                                   tie_word_embeddings=False)
    model = transformers.Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpness)
    return model


def shifted_teacher(seed=3):
    """``tiny_qwen2(0)`` with a rank-2 change to every layer's output projections: a teacher a LoRA can reach."""
    model, g = tiny_qwen2(0), torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in model.model.layers:
            for lin in (layer.self_attn.o_proj, layer.mlp.down_proj):
                out, inn = lin.weight.shape
                lin.weight += (torch.randn(out, 2, generator=g) @ torch.randn(2, inn, generator=g)) / inn ** 0.5
    return model


def teacher_samples(teacher_model, n=4, length=24, first=4, seed=1):
    """What the store would keep for ``teacher_model``'s own greedy-ish texts: its top-8 at every position."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        tokens = rng.integers(0, V, length).tolist()
        with torch.inference_mode():
            logits = teacher_model(torch.tensor([tokens])).logits[0].numpy()
        ids, lps = top_k_logprobs(logits[first - 1:length - 1], 8)
        out.append(Sample(tokens, first, list(ids), list(lps)))
    return out


@pytest.fixture(scope="module")
def trained():
    """A LoRA on a tiny Qwen2 distilled towards a changed copy's distributions for a hundred-odd steps."""
    student = Distiller(tiny_qwen2(0), rank=4, alpha=8, lr=3e-3)
    wins = windows(teacher_samples(shifted_teacher()), max_tokens=16, n_vocab=V)
    before = student.loss(wins)
    rnd = Round(wins, epochs=12, budget_s=120)
    assert rnd.run(student)
    return student, wins, before, rnd.report


def test_distillation_lowers_the_kl_to_the_teacher(trained):
    student, wins, before, report = trained
    assert report.steps == 12 * len(wins) and report.preempted == 0
    assert student.loss(wins) < 0.5 * before


def test_the_head_in_chunks_gives_the_loss_of_the_whole_head(trained, monkeypatch):
    """The vocabulary head runs on HEAD_ROWS judged rows at a time (a yield check between): the loss is the one
    over every row at once."""
    import tandem.cloud.learning.distill as distill
    student, wins, _, _ = trained
    w = max(wins, key=lambda w: w.positions)
    monkeypatch.setattr(distill, "HEAD_ROWS", 3)
    with torch.inference_mode():
        chunked = float(student._loss(w))
        logits = student.model(input_ids=torch.tensor([w.tokens])).logits[0][torch.from_numpy(w.rows)]
        whole = float(topk_forward_kl(logits, torch.from_numpy(w.top_ids), torch.from_numpy(w.top_logprobs)))
    assert w.positions > 3 and chunked == pytest.approx(whole, rel=1e-5)


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_a_step_traffic_interrupts_is_dropped_and_changes_nothing(trained, where):
    student, wins, _, _ = trained
    state = student.state()
    checks = []
    student.should_yield = lambda: checks.append(1) or False
    assert student.step(wins[0])  # (a whole step: how many checks it makes, forward and backward)
    per_step = len(checks) + 1  # (and the round's own, before it)
    student.load_state(state)
    assert per_step > 2 * len(student.model.get_base_model().model.layers)
    stop_at = 3 if where == "forward" else per_step - 1  # (the last check is in the backward pass)
    checks.clear()

    def traffic():
        checks.append(1)
        return len(checks) >= stop_at

    rnd = Round(wins, epochs=1, budget_s=60)
    assert not rnd.run(student, traffic)
    assert rnd.report.preempted == 1 and rnd.report.steps == 0 and rnd.cursor == 0
    after = student.state()
    for k, v in state["lora"].items():
        assert torch.equal(v, after["lora"][k]), k
    assert rnd.run(student)  # and the round goes on from there when the compute is free
    assert rnd.report.steps == len(wins)
    student.load_state(state)


def test_the_adapter_gguf_computes_in_llama_cpp_what_peft_computes(trained, tmp_path):
    """The distilled adapter, written as llama.cpp's LoRA GGUF and applied to the tiny model's GGUF in llama.cpp,
    moves the logits as the peft model moves them (float16 adapter tensors: to ~1e-3)."""
    from tiny_gguf import write_gguf

    from tandem.cloud.learning.lora_gguf import lora_gguf
    from tandem.core.llama_runtime import LlamaContext, LlamaModel, LoraAdapter
    student, _, _, _ = trained
    adapter = tmp_path / "adapter.gguf"
    adapter.write_bytes(lora_gguf(student.lora(), student.alpha, "qwen2", 2, base="tiny", version=1))
    path = write_gguf(tiny_qwen2(0), tmp_path / "tiny.gguf", vocab=True)  # (the student's base: the same seed)
    tokens = [5, 17, 33, 2, 40, 41, 8]
    with torch.inference_mode():
        want = student.model(input_ids=torch.tensor([tokens])).logits[0].numpy()
        with student.model.disable_adapter():
            plain = student.model(input_ids=torch.tensor([tokens])).logits[0].numpy()
    model = LlamaModel(path, extra_bufts=False)
    ctx = LlamaContext(model, 64, n_seq_max=1, n_batch=16, n_threads=1)
    lora = LoraAdapter(model, adapter)

    def run():
        ctx.clear()
        return ctx.decode(tokens, range(len(tokens)), [(0,)] * len(tokens), [True] * len(tokens)).copy()
    got_plain = run()
    ctx.set_lora(lora)
    got = run()
    ctx.set_lora(None)
    assert np.abs(run() - got_plain).max() == 0  # removed: the base weights again
    moved = np.abs(want - plain).max()
    assert moved > 0.05  # (the adapter does something worth checking)
    np.testing.assert_allclose(got_plain, plain, atol=2e-3)
    np.testing.assert_allclose(got - got_plain, want - plain, atol=3e-3 + 0.02 * moved)
    ctx.close()
    lora.close()
    model.close()


def test_a_file_that_is_not_an_adapter_of_this_model_is_refused(tmp_path, trained):
    from tiny_gguf import write_gguf

    from tandem.cloud.learning.lora_gguf import lora_gguf
    from tandem.core.llama_cpu import LlamaError
    from tandem.core.llama_runtime import LlamaModel, LoraAdapter
    student, _, _, _ = trained
    model = LlamaModel(write_gguf(tiny_qwen2(0), tmp_path / "tiny.gguf", vocab=True), extra_bufts=False)
    wrong = {k: (a, np.zeros((b.shape[0] + 1, b.shape[1]), np.float32)) for k, (a, b) in student.lora().items()}
    (tmp_path / "wrong.gguf").write_bytes(lora_gguf(wrong, 8, "qwen2", 2, base="tiny", version=1))
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf")
    for name in ("wrong.gguf", "junk.gguf"):
        with pytest.raises(LlamaError, match="could not load the LoRA adapter"):
            LoraAdapter(model, tmp_path / name)
    model.close()


def test_rounds_start_when_the_verifier_is_idle_and_publish_per_partition(trained):
    from tandem.cloud.learning.online import AdapterStore, OnlineConfig, OnlineDistillation
    student, _, _, _ = trained
    store, adapters = TeacherStore(k=8), AdapterStore()
    teacher = shifted_teacher()
    for part, seed in (("a", 1), ("b", 2)):
        for s in teacher_samples(teacher, n=2, seed=seed):
            ts = store.session(part, s.tokens[:s.first])
            with torch.inference_mode():
                logits = teacher(torch.tensor([s.tokens])).logits[0].numpy()
            ts.record(s.tokens[s.first:], logits[s.first - 1:-1])
    store.flush()
    now, idle = [0.0], [False]
    online = OnlineDistillation(store, adapters, drafter_source="tiny", idle=lambda: idle[0],
                                config=OnlineConfig(min_positions=10, round_budget_s=30, epochs=1, idle_s=1.0,
                                                    max_tokens=16), clock=lambda: now[0])
    online._distiller = student  # (the tiny model, not a drafter file)
    student_state = student.state()
    assert sorted(online.due()) == ["a", "b"]
    assert online.tick() is None  # busy
    idle[0] = True
    assert online.tick() is None  # idle, but not for idle_s yet
    now[0] = 1.5
    info = online.tick()
    assert info is not None and info.version == 1 and info.base == "tiny"
    assert adapters.info("a") == info and adapters.info("b") is None  # one partition's round
    assert adapters.get("b", info.sha256) is None and adapters.get("a", info.sha256)[1][:4] == b"GGUF"
    trained_a = student.lora()
    assert online.tick().version == 1 and adapters.info("b").sha256 != info.sha256
    # b has its own adapter; a's weights and optimizer moments were set aside, whole, for its next round
    kept_a = online._parts["a"].state
    assert kept_a is not None and online._live == "b"
    assert all(np.abs(trained_a[k][1] - b).max() > 0 for k, (_, b) in student.lora().items())
    student.load_state(kept_a)
    assert all(np.array_equal(trained_a[k][1], b) for k, (_, b) in student.lora().items())
    assert online.due() == [] and online.tick() is None  # nothing new filed
    student.load_state(student_state)


def test_a_partition_with_much_traffic_does_not_starve_another(trained):
    """Training time goes round-robin: "hog" files more than "quiet" before every tick and is due every time, and
    is the least recently written (its due listing comes first); quiet still has every other round."""
    from tandem.cloud.learning.online import AdapterStore, OnlineConfig, OnlineDistillation
    student, _, _, _ = trained
    initial = student.state()
    store, teacher = TeacherStore(k=8), shifted_teacher()

    def feed(part, n, seed):
        for s in teacher_samples(teacher, n=n, seed=seed):
            ts = store.session(part, s.tokens[:s.first], tenant=part)
            with torch.inference_mode():
                ts.record(s.tokens[s.first:], teacher(torch.tensor([s.tokens])).logits[0].numpy()[s.first - 1:-1])
        store.flush()

    online = OnlineDistillation(store, AdapterStore(), drafter_source="tiny", idle=lambda: True,
                                config=OnlineConfig(min_positions=10, round_budget_s=30, epochs=1, idle_s=0.0,
                                                    max_tokens=16))
    online._distiller = student  # (the tiny model, not a drafter file)
    order, run = [], online.run_round
    online.run_round = lambda p, **kw: order.append(p) or run(p, **kw)
    try:
        for seed in range(4):
            feed("hog", 2, 10 + seed)
            feed("quiet", 1, 20 + seed)
            assert online.due() == ["hog", "quiet"]
            assert online.tick() is not None
        assert order == ["hog", "quiet", "hog", "quiet"]
    finally:
        student.load_state(initial)


def test_stop_drops_the_step_in_progress_and_start_resumes_the_round(trained):
    from tandem.cloud.learning.online import AdapterStore, OnlineConfig, OnlineDistillation
    student, _, _, _ = trained
    initial = student.state()
    store, adapters = TeacherStore(k=8), AdapterStore()
    teacher = shifted_teacher()
    for s in teacher_samples(teacher, n=2, seed=3):
        ts = store.session("a", s.tokens[:s.first])
        with torch.inference_mode():
            ts.record(s.tokens[s.first:], teacher(torch.tensor([s.tokens])).logits[0].numpy()[s.first - 1:-1])
    store.flush()
    online = OnlineDistillation(store, adapters, drafter_source="tiny", idle=lambda: True,
                                config=OnlineConfig(min_positions=10, round_budget_s=60, epochs=200, idle_s=0.0,
                                                    max_tokens=16))
    online._distiller = student
    thread = online.start(poll_s=0.01)
    deadline = time.monotonic() + 60
    while (online.current is None or online.current.report.steps < 2) and time.monotonic() < deadline:
        time.sleep(0.01)
    rnd = online.current
    online.stop(timeout_s=30)
    assert rnd is not None and not thread.is_alive() and online.current is None
    assert rnd.report.preempted == 1 and adapters.info("a") is None  # dropped mid-round, nothing published
    steps = rnd.report.steps
    online.config = OnlineConfig(min_positions=10, round_budget_s=60, epochs=1, idle_s=0.0, max_tokens=16)
    online.start(poll_s=0.01)  # the same round goes on (its 200 epochs were fixed when it began)
    while rnd.report.steps < steps + 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    online.stop(timeout_s=30)
    assert rnd.report.steps >= steps + 2 and rnd.report.preempted == 2
    student.load_state(initial)


def test_saved_adapters_are_served_again_after_a_restart_and_a_tampered_one_is_not(tmp_path):
    import os

    from tandem.cloud.learning.adapter_dir import load_state, partition_dir, save_state
    from tandem.cloud.learning.online import AdapterStore
    from tandem.core import tenancy
    a, b = tenancy.partition("", "key-a"), tenancy.partition("", "key-b")
    store = AdapterStore(tmp_path)
    info_a = store.publish(a, b"GGUF adapter of a", "base", 3)
    store.publish(b, b"GGUF adapter of b", "base", 1)
    assert os.stat(partition_dir(tmp_path, a)).st_mode & 0o777 == 0o700
    assert os.stat(partition_dir(tmp_path, a) / "adapter.gguf").st_mode & 0o777 == 0o600
    (partition_dir(tmp_path, b) / "adapter.gguf").write_bytes(b"GGUF something else")  # (not what b published)
    again = AdapterStore(tmp_path)
    assert again.info(a) == info_a and again.get(a, info_a.sha256) == (info_a, b"GGUF adapter of a")
    assert again.info(b) is None
    with pytest.raises(ValueError, match="not a partition id"):
        store.publish("../elsewhere", b"x", "base", 1)
    assert AdapterStore().root is None and not list(tmp_path.glob("elsewhere*"))
    save_state(tmp_path, a, {"lora": {"w": torch.ones(2)}})
    assert torch.equal(load_state(tmp_path, a)["lora"]["w"], torch.ones(2))
    (partition_dir(tmp_path, a) / "state.pt").write_bytes(b"torn")  # (unreadable: the round starts afresh)
    assert load_state(tmp_path, a) is None and load_state(tmp_path, b) is None


def test_after_a_restart_a_partitions_training_goes_on_from_its_saved_state(trained, tmp_path):
    """With a directory, a finished round saves the adapter and its training state; a new process (a new store
    and distillation on that directory) serves the adapter at once and continues the training from that state,
    its versions going on from the saved one."""
    from tandem.cloud.learning.online import AdapterStore, OnlineConfig, OnlineDistillation
    from tandem.core import tenancy
    student, _, _, _ = trained
    initial = student.state()
    part = tenancy.partition("", "key-a")
    teacher = shifted_teacher()

    def online(store):
        for s in teacher_samples(teacher, n=2, seed=7):
            ts = store.session(part, s.tokens[:s.first])
            with torch.inference_mode():
                ts.record(s.tokens[s.first:], teacher(torch.tensor([s.tokens])).logits[0].numpy()[s.first - 1:-1])
        store.flush()
        o = OnlineDistillation(store, AdapterStore(tmp_path), drafter_source="tiny", idle=lambda: True,
                               config=OnlineConfig(min_positions=10, round_budget_s=30, epochs=1, idle_s=0.0,
                                                   max_tokens=16))
        o._distiller = student  # (the tiny model, not a drafter file)
        return o

    first = online(TeacherStore(k=8))
    student.load_state(None)
    published = first.tick()
    assert published is not None and published.version == 1
    trained_lora = student.lora()
    student.load_state(initial)  # (the new process's distiller starts from nothing)
    second = online(TeacherStore(k=8))
    assert second.adapters.info(part) == published  # served before any new round
    assert second.tick().version == 2
    saved = second._parts[part]
    assert saved.rounds == 2
    # the second round started from the first's adapter: a fresh start would have moved B from 0, not from it
    moved = {k: np.abs(b - trained_lora[k][1]).max() for k, (_, b) in student.lora().items()}
    fresh = {k: np.abs(b).max() for k, (_, b) in trained_lora.items()}
    assert all(moved[k] < fresh[k] for k in moved)
    student.load_state(initial)


def test_an_adapter_goes_when_its_lineage_is_older_than_the_store_keeps_text(tmp_path):
    """An adapter lives ``max_age_s`` from the start of the training it continues: then it is not named, not
    served, and its directory (adapter, record, training state) is gone; a restart drops what expired meanwhile."""
    from tandem.cloud.learning.adapter_dir import partition_dir, save_state
    from tandem.cloud.learning.online import AdapterStore
    from tandem.core import tenancy
    a, b = tenancy.partition("", "key-a"), tenancy.partition("", "key-b")
    now = [1000.0]
    store = AdapterStore(tmp_path, max_age_s=100, clock=lambda: now[0])
    info_a = store.publish(a, b"GGUF adapter of a", "base", 1)  # a lineage that begins now
    save_state(tmp_path, a, {"lora": {"w": torch.ones(2)}})
    info_b = store.publish(b, b"GGUF adapter of b", "base", 4, lineage_s=950.0)  # one that began 50 s ago
    now[0] = 1049.0
    assert store.info(b) == info_b and store.get(b, info_b.sha256) is not None and store.lineage(b) == 950.0
    now[0] = 1050.0
    assert store.info(b) is None and store.get(b, info_b.sha256) is None and store.lineage(b) is None
    assert not partition_dir(tmp_path, b).exists()
    assert store.info(a) == info_a and store.lineage(a) == 1000.0
    assert AdapterStore(tmp_path, max_age_s=100, clock=lambda: 1099.0).info(a) == info_a
    assert AdapterStore(tmp_path, max_age_s=100, clock=lambda: 1100.0).info(a) is None
    assert not partition_dir(tmp_path, a).exists()  # (its training state with it)
    with pytest.raises(ValueError, match="max_age_s"):
        AdapterStore(max_age_s=0)


def test_a_partitions_training_starts_afresh_before_its_adapter_expires(trained):
    """Rounds continue one lineage until it is half the adapters' lifetime old; the next round starts from the
    adapter as first made (a new lineage, published before the old would expire), and training state past the
    lifetime is dropped with its adapter even when no round is due."""
    from tandem.cloud.learning.online import AdapterStore, OnlineConfig, OnlineDistillation
    from tandem.core import tenancy
    student, _, _, _ = trained
    initial = student.state()
    part = tenancy.partition("", "key-a")
    teacher = shifted_teacher()
    store, now = TeacherStore(k=8), [0.0]
    o = OnlineDistillation(store, AdapterStore(max_age_s=100, clock=lambda: now[0]), drafter_source="tiny",
                           idle=lambda: True, config=OnlineConfig(min_positions=10, round_budget_s=30, epochs=1,
                                                                  idle_s=0.0, max_tokens=16))
    o._distiller = student  # (the tiny model, not a drafter file)
    loaded = []
    student.load_state, load = (lambda state: (loaded.append(state), load(state))[1]), student.load_state

    def round_at(t, seed):
        now[0] = t
        for s in teacher_samples(teacher, n=1, seed=seed):
            ts = store.session(part, s.tokens[:s.first])
            with torch.inference_mode():
                ts.record(s.tokens[s.first:], teacher(torch.tensor([s.tokens])).logits[0].numpy()[s.first - 1:-1])
        store.flush()
        loaded.clear()
        return o.tick()

    try:
        student.load_state(None)
        assert round_at(0.0, 1).version == 1 and o.adapters.lineage(part) == 0.0
        assert round_at(40.0, 2).version == 2 and o.adapters.lineage(part) == 0.0  # the same lineage goes on
        assert loaded == []  # (the distiller held this partition's training: nothing swapped in)
        assert round_at(50.0, 3).version == 3 and o.adapters.lineage(part) == 50.0  # half the lifetime: afresh
        assert loaded == [None]  # from the adapter as first made
        now[0] = 120.0  # the first lineage would be gone; the new one is served
        assert o.adapters.info(part).version == 3
        now[0] = 150.0
        assert o.tick() is None and o.adapters.info(part) is None  # nothing due, the expired training dropped
        assert o._parts[part].state is None and o._parts[part].lineage_s is None and loaded == [None, None]
    finally:
        del student.load_state
        student.load_state(initial)


def test_an_onnx_drafter_drafts_with_the_adapter_merged_into_its_export(trained, tmp_path):
    """The ONNX drafter takes an adapter by export: the adapter merged into the weights (W + alpha/r B A) gives
    the logits peft gives; set_adapter(None) goes back to the export without it."""
    pytest.importorskip("onnxruntime")
    from tiny_gguf import write_gguf

    from tandem.cloud.learning.lora_gguf import lora_gguf
    from tandem.edge.onnx_drafter import OnnxDrafter
    from tandem.edge.export.onnx_export import export
    student, _, _, _ = trained
    source = write_gguf(tiny_qwen2(0), tmp_path / "tiny.gguf", vocab=True)
    adapter = tmp_path / "adapter.gguf"
    adapter.write_bytes(lora_gguf(student.lora(), student.alpha, "qwen2", 2, base="tiny", version=1))
    drafter = OnnxDrafter(export(source, "fp32", cache_root=tmp_path / "onnx"), n_ctx=64)
    tokens = [5, 17, 33, 2, 40, 41, 8]
    with torch.inference_mode():
        want = student.model(input_ids=torch.tensor([tokens])).logits[0].numpy()
        with student.model.disable_adapter():
            plain = student.model(input_ids=torch.tensor([tokens])).logits[0].numpy()
    np.testing.assert_allclose(drafter.score(tokens), plain, atol=1e-3)
    merged = drafter.prepare_adapter(adapter)
    assert merged != drafter.dir and (merged / "meta.json").is_file()
    drafter.set_adapter(merged)
    np.testing.assert_allclose(drafter.score(tokens), want, atol=3e-3 + 0.02 * np.abs(want - plain).max())
    drafter.set_adapter(None)
    np.testing.assert_allclose(drafter.score(tokens), plain, atol=1e-3)
