"""smg-demo's restart delay for a lost worker: short for a one-off loss, backing off for one that keeps dying."""

from __future__ import annotations

from smg_sim.demo import RESTART_DELAY_MAX_S, RESTART_DELAY_S, STABLE_RUN_S, restart_delay


def test_a_first_loss_is_restarted_after_the_short_delay() -> None:
    assert restart_delay(None, ran_for=0.5) == RESTART_DELAY_S


def test_a_worker_dying_right_after_its_restart_waits_twice_as_long_each_time_up_to_a_cap() -> None:
    delays = [RESTART_DELAY_S]
    for _ in range(8):
        delays.append(restart_delay(delays[-1], ran_for=1.0))
    assert delays[:4] == [RESTART_DELAY_S, 2 * RESTART_DELAY_S, 4 * RESTART_DELAY_S, 8 * RESTART_DELAY_S]
    assert max(delays) == delays[-1] == RESTART_DELAY_MAX_S


def test_a_worker_that_ran_a_while_before_dying_gets_the_short_delay_again() -> None:
    assert restart_delay(RESTART_DELAY_MAX_S, ran_for=STABLE_RUN_S) == RESTART_DELAY_S
