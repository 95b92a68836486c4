"""Ranking: what a board ranks, owned once, below reporting and execution. (Not ``results``:
that is the API's function, ``rayeval.results(store)``, which a subpackage of that name would
shadow once imported.)

    rules      the headline rule (an evaluation's headline metric: a sweep's front door and
               stored rows'), the group-member rule, a metric's direction
    replicates what a row's bootstrap replicates say: whether two rows pair, percentile
               intervals of many rows at once (numpy)
    win_rate   the mean win rate, the default aggregate: shares of the checkpoints beaten,
               on the values and on every replicate
    aggregate  the suite aggregate over evaluations (the mean win rate by default; a mean or a
               weighted mean as the sweep's aggregate: says) and its interval, from rows in
               hand or a store's rows (with the suite files beside its parts)
    suite      those suite files, computed when a part is written
    columns    a board's columns and the one a user names
    board      the board: ``board(store, ...)``, the one entry that the API and every format
               of ``rayeval leaderboard`` call; ``run_board``, a run's (what ``rayeval run``
               prints, ``RunReport.board``, the trackers' table); ``build_board`` of rows in
               hand
    compare    paired bootstrap differences; finding the checkpoint a user named
    stored     the rows a board or a comparison reads, with only the replicates it needs

Importing this package imports neither torch nor Ray (intervals import torch when computed).
"""

from rayeval.ranking.aggregate import (AGGREGATE, aggregate_row, aggregate_spec, aggregates,
                                       stored_aggregates)
from rayeval.ranking.board import (Board, Entry, board, build_board, latest_rows, mark,
                                   run_board, without_members)
from rayeval.ranking.columns import (AGGREGATE_COLUMN, Column, columns_of, ranked_rows,
                                     resolve_metric)
from rayeval.ranking.compare import Comparison, Paired, compare, find_checkpoint, paired
from rayeval.ranking.rules import direction, members, stored_headlines, sweep_headline
from rayeval.ranking.win_rate import win_rates, win_shares

__all__ = ["AGGREGATE", "AGGREGATE_COLUMN", "Board", "Column", "Comparison", "Entry", "Paired",
           "aggregate_row", "aggregate_spec", "aggregates", "board", "build_board", "columns_of",
           "compare", "direction", "find_checkpoint", "latest_rows", "mark", "members", "paired",
           "ranked_rows", "resolve_metric", "run_board", "stored_aggregates", "stored_headlines",
           "sweep_headline", "win_rates", "win_shares", "without_members"]
