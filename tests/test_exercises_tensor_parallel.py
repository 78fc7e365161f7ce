"""Notebook 08's exercise seam and check: every tensor-parallel rank calls the seam, the check accepts nanoref's own
lookup and rejects typical wrong answers with a message that names the mistake."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch.distributed import all_reduce as summed_over_ranks

from nanoref import LLM, SamplingParams
from nanoref.exercises import ExerciseFailure, check_vocab_parallel_embed
from nanoref.exercises.tensor_parallel import find_collective
from nanoref.layers.embed_head import vocab_parallel_embed
from nanoref.parallel.state import shard_range
from nanoref.parallel.tensor_parallel import rank_layout
from nanoref.testing import make_tiny_qwen3
from nanoref.utils import seams

from .helpers import assert_readable_failure, random_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


# -- wrong answers, importable by name (a tensor-parallel worker unpickles them from this module) ------------
def no_shift(input_ids, weight, vocab_start, vocab_end):  # looks up the id itself, not id - vocab_start
    mine = (input_ids >= vocab_start) & (input_ids < vocab_end)
    return F.embedding((input_ids * mine).clamp(max=weight.shape[0] - 1), weight) * mine[:, None].to(weight.dtype)


def no_shift_raw(input_ids, weight, vocab_start, vocab_end):  # the same, without the clamp: an index error
    mine = (input_ids >= vocab_start) & (input_ids < vocab_end)
    return F.embedding(input_ids * mine, weight) * mine[:, None].to(weight.dtype)


def no_mask(input_ids, weight, vocab_start, vocab_end):  # every id looked up, the other ranks' clamped into range
    return F.embedding((input_ids - vocab_start).clamp(0, weight.shape[0] - 1), weight)


def padding_row(input_ids, weight, vocab_start, vocab_end):  # other ranks' ids sent to the last row, not zeroed
    mine = (input_ids >= vocab_start) & (input_ids < vocab_end)
    return F.embedding(torch.where(mine, input_ids - vocab_start, weight.shape[0] - 1), weight)


def padding_times_zero(input_ids, weight, vocab_start, vocab_end):  # other ranks' ids clamped into padding, times 0
    mine = (input_ids >= vocab_start) & (input_ids < vocab_end)
    rows = F.embedding((input_ids - vocab_start).clamp(0, weight.shape[0] - 1), weight)
    return rows * mine[:, None].to(weight.dtype)


def float_mask(input_ids, weight, vocab_start, vocab_end):  # right values, but promoted to float32
    mine = (input_ids >= vocab_start) & (input_ids < vocab_end)
    return F.embedding((input_ids - vocab_start) * mine, weight) * mine[:, None].float()


def range_by_table_size(input_ids, weight, vocab_start, vocab_end):  # ids up to the table's end count as mine
    local = input_ids - vocab_start
    mine = (local >= 0) & (local < weight.shape[0])
    return F.embedding(local * mine, weight) * mine[:, None].to(weight.dtype)


def extra_axis(input_ids, weight, vocab_start, vocab_end):
    return vocab_parallel_embed(input_ids, weight, vocab_start, vocab_end)[:, None]


def in_place(input_ids, weight, vocab_start, vocab_end):
    mine = (input_ids >= vocab_start) & (input_ids < vocab_end)
    input_ids -= vocab_start
    return F.embedding(input_ids * mine, weight) * mine[:, None].to(weight.dtype)


def wrong_on_rank_1(input_ids, weight, vocab_start, vocab_end):  # rank 0 right, rank 1 forgets its zeros
    if vocab_start == 0:
        return vocab_parallel_embed(input_ids, weight, vocab_start, vocab_end)
    return no_mask(input_ids, weight, vocab_start, vocab_end)


def counting(calls):
    def wrapper(input_ids, weight, vocab_start, vocab_end):
        calls.append((vocab_start, vocab_end))
        return vocab_parallel_embed(input_ids, weight, vocab_start, vocab_end)

    return wrapper


def test_nanorefs_lookup_sums_to_the_whole_table():
    """The ranks' partial lookups add up to the whole table's rows; each rank leaves the other's ids at zero."""
    generator = torch.Generator().manual_seed(0)
    full = torch.randn(11, 6, generator=generator)  # 11 ids over 2 ranks: 6 rows each, the second ends in padding
    ids = torch.randint(0, 11, (20,), generator=generator)
    tables = [full[:6], torch.cat([full[6:], torch.zeros(1, 6)])]
    parts = [vocab_parallel_embed(ids, table, *shard_range(11, rank, 2)) for rank, table in enumerate(tables)]
    assert torch.equal(parts[0] + parts[1], F.embedding(ids, full))
    assert not parts[0][ids >= 6].any() and not parts[1][ids < 6].any()


def test_checks_accept_nanorefs_own_function():
    check_vocab_parallel_embed(vocab_parallel_embed)


@pytest.mark.parametrize(
    "wrong, message",
    [
        (no_shift, "subtract vocab_start"),
        (no_shift_raw, "raised IndexError.*subtract vocab_start"),
        (no_mask, "is not zero.*zero the rows of ids outside"),
        (padding_row, "sending other ranks. ids to the last row"),
        (padding_times_zero, "is NaN: you looked it up in a padding row and multiplied by 0.*torch.where"),
        (float_mask, "dtype torch.float32, expected torch.bfloat16"),
        (extra_axis, "returned shape"),
        (
            range_by_table_size,
            "holds padding row .*: test the ids against \\[vocab_start, vocab_end\\), not the table's size",
        ),
        (in_place, "changed its input_ids in place"),
    ],
)
def test_checks_name_the_mistake(wrong, message):
    with pytest.raises(ExerciseFailure, match="(?s)" + message) as failure:
        check_vocab_parallel_embed(wrong, engine=False)
    assert_readable_failure(failure.value)


def test_an_unwritten_exercise_raises_not_implemented():
    def unwritten(input_ids, weight, vocab_start, vocab_end):
        raise NotImplementedError()

    with pytest.raises(NotImplementedError):
        check_vocab_parallel_embed(unwritten, engine=False)


@pytest.fixture(scope="module")
def odd_vocab_model(tmp_path_factory):
    return make_tiny_qwen3(tmp_path_factory.mktemp("tp_exercise") / "m", seed=31, vocab_size=251)


@pytest.fixture(scope="module")
def two_ranks(odd_vocab_model):
    with LLM(odd_vocab_model, device="cpu", tensor_parallel_size=2) as llm:
        yield llm


def test_every_rank_calls_the_seam_and_a_wrong_lookup_changes_the_tokens(odd_vocab_model, two_ranks):
    """Rank 0 calls the seam with its own vocabulary range; rank 1 too (a wrong lookup on rank 1 alone changes the
    tokens); one rank (tp=1) never calls it."""
    prompts = random_prompts(seed=14, lengths=[6, 19], vocab=251)
    other = random_prompts(seed=15, lengths=[7, 22], vocab=251)
    calls = []
    one = LLM(odd_vocab_model, device="cpu")
    with seams.use(vocab_parallel_embed=counting(calls)):
        reference = one.generate(prompts, GREEDY, use_tqdm=False)
    assert not calls, "one rank has no vocab-parallel lookup"
    expected_other = one.generate(other, GREEDY, use_tqdm=False)
    layouts = two_ranks.model_runner.run_on_all_ranks(rank_layout)
    with seams.use(vocab_parallel_embed=counting(calls)):
        assert two_ranks.generate(prompts, GREEDY, use_tqdm=False) == reference
    assert calls and set(calls) == {layouts[0]["vocab_rows"]} == {(0, 126)}
    assert layouts[1]["vocab_rows"] == (126, 251) and layouts[1]["table_rows"] == 126
    with seams.use(vocab_parallel_embed=wrong_on_rank_1):  # other prompts, so no step reuses the last ones' K/V
        broken = two_ranks.generate(other, GREEDY, use_tqdm=False)
    assert broken != expected_other


def test_a_function_collected_from_a_notebook_reaches_the_worker(odd_vocab_model, two_ranks, tmp_path):
    """The capstone imports each exercise cell as a module file the worker cannot import: it must travel by value."""
    nbformat = pytest.importorskip("nbformat", reason="nbformat is not installed (pip install 'nanoref[classroom]')")

    from nanoref.classroom import collect_solutions

    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell(
        "import torch\nimport torch.nn.functional as F\n\n\n"
        "def vocab_parallel_embed(input_ids, weight, vocab_start, vocab_end):\n"
        "    mine = (input_ids >= vocab_start) & (input_ids < vocab_end)\n"
        "    local = torch.where(mine, input_ids - vocab_start, 0)\n"
        "    return F.embedding(local, weight) * mine[:, None].to(weight.dtype)\n"
    )
    cell.metadata["nbgrader"] = dict(
        solution=True, grade=False, locked=False, grade_id="ex_vocab_parallel_embed", schema_version=3, task=False
    )
    nb.cells = [cell]
    nbformat.write(nb, tmp_path / "08.ipynb")
    collected = collect_solutions(tmp_path)["vocab_parallel_embed"]
    prompts = random_prompts(seed=16, lengths=[9, 30], vocab=251)
    expected = LLM(odd_vocab_model, device="cpu").generate(prompts, GREEDY, use_tqdm=False)
    with seams.use(vocab_parallel_embed=collected):
        assert two_ranks.generate(prompts, GREEDY, use_tqdm=False) == expected


def after_vocab_start(input_ids, weight, vocab_start, vocab_end):  # > where >= belongs: vocab_start itself zeroed
    mine = (input_ids > vocab_start) & (input_ids < vocab_end)
    return F.embedding(torch.where(mine, input_ids - vocab_start, 0), weight) * mine[:, None].to(weight.dtype)


def through_vocab_end(input_ids, weight, vocab_start, vocab_end):  # <= where < belongs: the next rank's first id
    mine = (input_ids >= vocab_start) & (input_ids <= vocab_end)
    local = torch.where(mine, input_ids - vocab_start, 0).clamp(max=weight.shape[0] - 1)
    return F.embedding(local, weight) * mine[:, None].to(weight.dtype)


@pytest.mark.parametrize(
    "wrong, message",
    [
        (after_vocab_start, "is zero, but id \\d+ is this rank's \\(vocab_start itself: the range includes it"),
        (through_vocab_end, "is vocab_end, the first id of rank \\d+:\\s+the range \\[vocab_start, vocab_end\\)"),
    ],
)
def test_an_off_by_one_at_a_shard_boundary_is_named(wrong, message):
    with pytest.raises(ExerciseFailure, match="(?s)" + message) as failure:
        check_vocab_parallel_embed(wrong, engine=False)
    assert_readable_failure(failure.value)


def all_reduces_itself(input_ids, weight, vocab_start, vocab_end):  # the engine's all-reduce, done a second time
    hidden = vocab_parallel_embed(input_ids, weight, vocab_start, vocab_end)
    torch.distributed.all_reduce(hidden)
    return hidden


def float_local_ids(input_ids, weight, vocab_start, vocab_end):  # an index of the wrong dtype: not past the table
    mine = (input_ids >= vocab_start) & (input_ids < vocab_end)
    return weight[((input_ids - vocab_start) * mine).float()] * mine[:, None].to(weight.dtype)


def all_reduces_where_initialized(input_ids, weight, vocab_start, vocab_end):  # the same, behind a guard
    hidden = vocab_parallel_embed(input_ids, weight, vocab_start, vocab_end)
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.all_reduce(hidden)
    return hidden


def test_an_answer_that_all_reduces_is_told_the_engine_does():
    with pytest.raises(ExerciseFailure, match=r"(?s)raised ValueError.*this rank's share only, with no all-reduce"):
        check_vocab_parallel_embed(all_reduces_itself, engine=False)


@pytest.mark.parametrize("seed", range(5))
def test_an_all_reduce_guarded_by_is_initialized_is_caught_on_every_seed(seed):
    """nanoref's engine never initializes torch.distributed's default group, so the guarded all-reduce runs in no
    call of the check, nor in the engine run: the check finds it in the answer's code, names its line, and says the
    engine all-reduces, leaving torch.distributed as it found it (no default group)."""
    with pytest.raises(ExerciseFailure) as failure:
        check_vocab_parallel_embed(all_reduces_where_initialized, seed=seed, engine=False)
    message = str(failure.value).replace("\n", " ")
    assert "calls torch.distributed.all_reduce (test_exercises_tensor_parallel.py:" in message
    assert "in all_reduces_where_initialized)" in message
    assert "this rank's share only, with no all-reduce (not even under `if dist.is_initialized()`)" in message
    assert "the engine's embedding all-reduces" in message
    assert not dist.is_initialized()


# -- collectives in other forms, each where no process group exists (so none of them runs in the check) ------------
def all_reduces_async(input_ids, weight, vocab_start, vocab_end):
    hidden = vocab_parallel_embed(input_ids, weight, vocab_start, vocab_end)
    if dist.is_initialized():
        dist.all_reduce(hidden, async_op=True).wait()
    return hidden


def all_reduces_functionally(input_ids, weight, vocab_start, vocab_end):
    hidden = vocab_parallel_embed(input_ids, weight, vocab_start, vocab_end)
    if dist.is_initialized():
        hidden = funcol.all_reduce(hidden, "sum", dist.group.WORLD)
    return hidden


def _gathered(hidden):  # a helper of the answer's own module
    if dist.is_initialized():
        out = hidden.new_empty(dist.get_world_size() * hidden.shape[0], hidden.shape[1])
        dist.all_gather_into_tensor(out, hidden)
        return out.view(-1, *hidden.shape).sum(0)
    return hidden


def all_gathers_in_a_helper(input_ids, weight, vocab_start, vocab_end):
    return _gathered(vocab_parallel_embed(input_ids, weight, vocab_start, vocab_end))


def imports_its_collective(input_ids, weight, vocab_start, vocab_end):
    from torch.distributed import reduce_scatter_tensor

    hidden = vocab_parallel_embed(input_ids, weight, vocab_start, vocab_end)
    if dist.is_initialized():
        reduce_scatter_tensor(hidden, hidden.repeat(dist.get_world_size(), 1))
    return hidden


def all_reduces_in_a_lambda(input_ids, weight, vocab_start, vocab_end):
    summed = lambda hidden: dist.all_reduce(hidden) if dist.is_initialized() else None  # noqa: E731
    hidden = vocab_parallel_embed(input_ids, weight, vocab_start, vocab_end)
    summed(hidden)
    return hidden


def all_reduces_under_an_alias(input_ids, weight, vocab_start, vocab_end):  # imported as summed_over_ranks
    hidden = vocab_parallel_embed(input_ids, weight, vocab_start, vocab_end)
    if dist.is_initialized():
        summed_over_ranks(hidden)
    return hidden


def all_reduces_by_getattr(input_ids, weight, vocab_start, vocab_end):
    hidden = vocab_parallel_embed(input_ids, weight, vocab_start, vocab_end)
    if dist.is_initialized():
        getattr(dist, "all_reduce")(hidden)  # noqa: B009
    return hidden


class _Summer:  # a class of the answer's own module
    @staticmethod
    def sum_over_ranks(hidden):
        if dist.is_initialized():
            dist.all_to_all_single(hidden, hidden)
        return hidden


def all_to_alls_in_a_method(input_ids, weight, vocab_start, vocab_end):
    return _Summer.sum_over_ranks(vocab_parallel_embed(input_ids, weight, vocab_start, vocab_end))


def all_reduces_on_the_process_group(input_ids, weight, vocab_start, vocab_end):  # a ProcessGroup's own method
    hidden = vocab_parallel_embed(input_ids, weight, vocab_start, vocab_end)
    if dist.is_initialized():
        pg = dist.group.WORLD
        pg.allreduce([hidden]).wait()
    return hidden


def broadcasts_on_a_group(input_ids, weight, vocab_start, vocab_end):
    hidden = vocab_parallel_embed(input_ids, weight, vocab_start, vocab_end)
    if dist.is_initialized():
        group = dist.new_group()
        group.broadcast([hidden]).wait()
    return hidden


def reduces_on_a_group(input_ids, weight, vocab_start, vocab_end):  # `reduce`, a name others share, on a group
    hidden = vocab_parallel_embed(input_ids, weight, vocab_start, vocab_end)
    if dist.is_initialized():
        tp_group = dist.new_group()
        tp_group.reduce([hidden], dist.ReduceOptions()).wait()
    return hidden


def sends_to_rank_0(input_ids, weight, vocab_start, vocab_end):  # point to point: the others' shares to rank 0
    hidden = vocab_parallel_embed(input_ids, weight, vocab_start, vocab_end)
    if dist.is_initialized() and dist.get_rank() > 0:
        dist.send(hidden, 0)
    return hidden


def isends_to_rank_0(input_ids, weight, vocab_start, vocab_end):
    hidden = vocab_parallel_embed(input_ids, weight, vocab_start, vocab_end)
    if dist.is_initialized() and dist.get_rank() > 0:
        dist.isend(hidden, 0).wait()
    return hidden


@pytest.mark.parametrize(
    "wrong, collective, where",
    [
        (all_reduces_under_an_alias, "torch.distributed.all_reduce", "all_reduces_under_an_alias"),
        (all_reduces_by_getattr, "torch.distributed.all_reduce", "all_reduces_by_getattr"),
        (all_to_alls_in_a_method, "torch.distributed.all_to_all_single", "sum_over_ranks"),
        (all_reduces_async, "torch.distributed.all_reduce", "all_reduces_async"),
        (all_reduces_functionally, "torch.distributed._functional_collectives.all_reduce", "all_reduces_functionally"),
        (all_gathers_in_a_helper, "torch.distributed.all_gather_into_tensor", "_gathered"),
        (imports_its_collective, "torch.distributed.reduce_scatter_tensor", "imports_its_collective"),
        (all_reduces_in_a_lambda, "torch.distributed.all_reduce", "<lambda>"),
        (all_reduces_on_the_process_group, "pg.allreduce", "all_reduces_on_the_process_group"),
        (broadcasts_on_a_group, "group.broadcast", "broadcasts_on_a_group"),
        (reduces_on_a_group, "tp_group.reduce", "reduces_on_a_group"),
        (sends_to_rank_0, "torch.distributed.send", "sends_to_rank_0"),
        (isends_to_rank_0, "torch.distributed.isend", "isends_to_rank_0"),
    ],
)
def test_a_collective_in_any_form_is_named(wrong, collective, where):
    with pytest.raises(ExerciseFailure) as failure:
        check_vocab_parallel_embed(wrong, engine=False)
    message = str(failure.value).replace("\n", " ")
    assert re.search(
        rf"calls {re.escape(collective)} \(test_exercises_tensor_parallel.py:\d+, in {re.escape(where)}\)", message
    ), message
    assert "this rank's share only, with no all-reduce (not even under `if dist.is_initialized()`)" in message
    assert_readable_failure(failure.value)


def mentions_dist(input_ids, weight, vocab_start, vocab_end):  # right: dist read, but no collective called
    # no dist.all_reduce(hidden) here: the engine all-reduces every rank's output
    from functools import reduce

    import torch.distributed as tdist  # noqa: F401 (imported, never called)

    ranks = dist.get_world_size() if dist.is_initialized() else 1
    assert ranks >= 1 and reduce(lambda a, b: a + b, [vocab_start, 0]) == vocab_start
    mine = (input_ids >= vocab_start) & (input_ids < vocab_end)
    rows = torch.gather(weight, 0, torch.where(mine, input_ids - vocab_start, 0)[:, None].expand(-1, weight.shape[1]))
    return rows * mine[:, None].to(weight.dtype)


def test_an_answer_that_only_mentions_dist_passes():
    check_vocab_parallel_embed(mentions_dist, engine=False)


def test_an_answer_without_source_is_checked_by_running_it():
    """A function whose source cannot be read (a lambda of exec'd code) has nothing to search: the check runs it."""
    namespace = {"vocab_parallel_embed": vocab_parallel_embed, "dist": dist}
    exec("answer = lambda *args: vocab_parallel_embed(*args)\nguarded = lambda h: dist.all_reduce(h)", namespace)
    assert find_collective(namespace["guarded"]) is None
    check_vocab_parallel_embed(namespace["answer"], engine=False)


def test_an_index_of_the_wrong_dtype_is_not_told_to_subtract_vocab_start():
    with pytest.raises(ExerciseFailure, match="tensors used as indices must be long") as failure:
        check_vocab_parallel_embed(float_local_ids, engine=False)
    assert "subtract vocab_start" not in str(failure.value)


_GLOBAL_STATE_SCRIPT = """
import os, sys
import torch.distributed as dist
from nanoref.exercises import ExerciseFailure, check_vocab_parallel_embed
from nanoref.exercises.tensor_parallel import find_collective
from nanoref.layers.embed_head import vocab_parallel_embed
from tests.test_exercises_tensor_parallel import all_reduces_itself, all_reduces_where_initialized

def state():
    return list(dist.Backend.backend_list), dict(os.environ), sys.excepthook, dist.is_initialized()

before, seen = state(), []

def watching(*args):  # what the answer sees of the process while the check calls it
    seen.append(state())
    return vocab_parallel_embed(*args)

check_vocab_parallel_embed(watching, engine=False)
for wrong in (all_reduces_itself, all_reduces_where_initialized):
    try:
        check_vocab_parallel_embed(wrong, engine=False)
    except ExerciseFailure:
        pass
    else:
        raise SystemExit(f"{wrong.__name__} passed")
assert seen and all(one == before for one in seen), "the answer ran in a process the check had changed"
assert state() == before, "the check left the process changed"
"""


def test_the_check_leaves_the_processs_global_state_as_it_found_it():
    """The check changes nothing in the learner's process, neither while it calls the answer nor after:
    torch.distributed's backend registry (`dist.Backend.backend_list`), os.environ (TORCH_DIST_INIT_BARRIER among
    it), sys.excepthook, and no default process group. A fresh process, so that nothing an earlier test did hides
    a change."""
    env = {**os.environ, "TORCH_DIST_INIT_BARRIER": "1"}
    root = Path(__file__).resolve().parents[1]
    result = subprocess.run(
        [sys.executable, "-c", _GLOBAL_STATE_SCRIPT], cwd=root, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]


def reduces_to_rank_0(input_ids, weight, vocab_start, vocab_end):
    hidden = vocab_parallel_embed(input_ids, weight, vocab_start, vocab_end)
    if dist.is_initialized():
        dist.reduce(hidden, dst=0)
    return hidden


def gathers_to_rank_0(input_ids, weight, vocab_start, vocab_end):
    hidden = vocab_parallel_embed(input_ids, weight, vocab_start, vocab_end)
    if dist.is_initialized():
        dist.gather(hidden, [torch.empty_like(hidden) for _ in range(dist.get_world_size())], dst=0)
    return hidden


@pytest.mark.parametrize("wrong, collective", [(reduces_to_rank_0, "reduce"), (gathers_to_rank_0, "gather")])
def test_a_guarded_collective_whose_name_torch_shares_is_named_too(wrong, collective):
    """torch.distributed's reduce and gather share their names with torch.gather and functools.reduce, which a right
    answer may call (`mentions_dist` does): they are found where the name is torch.distributed's."""
    with pytest.raises(ExerciseFailure, match=rf"calls torch\.distributed\.{collective} \("):
        check_vocab_parallel_embed(wrong, engine=False)
