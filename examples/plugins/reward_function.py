"""A tandem plugin: a reward function for the rows whose ``data_source`` is ``word_overlap``.

    tandem train --plugin examples/plugins/reward_function.py data.train_path=my_rows.parquet ...

The reward manager scores each response with the scorer registered for its row's
``data_source``; a scorer returns a float, or a dict with the ``score`` to train on and an
exact ``acc`` that validation reports. (``reward.custom_path`` instead names one function for
every row.)
"""

from tandem.rl.rewards import register_scorer


@register_scorer("word_overlap")
def word_overlap(solution: str, ground_truth: str, extra_info: dict) -> dict[str, float]:
    """The share of the ground truth's words the response contains (``score``); ``acc`` is 1
    when the response is the ground truth, words in order."""
    expected, given = ground_truth.lower().split(), solution.lower().split()
    found = sum(word in given for word in expected)
    return {"score": found / max(len(expected), 1), "acc": float(given == expected)}
