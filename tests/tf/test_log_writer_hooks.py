"""Which hooks of a rank-0-only writer the other ranks meet at ([Note: a writer failing on rank
0] in tfsmp/keras/log_writers.py): each costs a broadcast per call, so a hook that cannot print
or fail is not met."""

from __future__ import annotations

import keras

from tfsmp.keras.log_writers import Writer


class _Bar(keras.callbacks.ProgbarLogger):
    def on_train_batch_end(self, batch: int, logs: object = None) -> None:
        raise RuntimeError("a subclass's own batch hook may fail")


def _batch(writer: Writer) -> list[str]:
    return [h for h in writer.hooks if "batch" in h]


def test_keras_progress_bar_is_met_per_batch_only_where_it_prints_per_batch() -> None:
    bar = keras.callbacks.ProgbarLogger()
    assert _batch(Writer.of(bar, 1)) != []      # verbose=1: a line per batch
    assert _batch(Writer.of(bar, "auto")) != []
    assert _batch(Writer.of(bar, 2)) == []      # an epoch's line only
    assert _batch(Writer.of(bar, 0)) == []      # nothing printed at all
    assert "on_epoch_end" in Writer.of(bar, 0).hooks


def test_a_subclass_with_its_own_batch_hook_is_still_met_at_verbose_0() -> None:
    assert "on_train_batch_end" in Writer.of(_Bar(), 0).hooks
