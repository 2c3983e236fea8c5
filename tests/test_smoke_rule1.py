from tests.conftest import created, states


def test_rule1_mark_marks_created_rows_the_report_lacks(plane, make_worker):
    w = make_worker()
    created(plane, "w1", "c1", "c2")
    w.report(containers=["c1"])
    assert states(plane) == {"c1": ("created", False), "c2": ("created", True)}


def test_rule4_delete_after_grace_confirmed(plane, make_worker, advance):
    w = make_worker()
    created(plane, "w1", "c1")
    w.report()
    advance(minutes=5)
    w.heartbeat()
    plane.collect()
    assert states(plane) == {"c1": ("created", True)}
    w.report()
    plane.collect()
    assert states(plane) == {}
