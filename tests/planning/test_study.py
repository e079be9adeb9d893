"""The paper-scale study runs and reports every schedule (small case to stay fast)."""
from megatron_pipemesh.planning.costs import ModelSpec
from megatron_pipemesh.planning.study import StudyCase, markdown, run_case


def test_study_case_reports_all_schedules():
    """A study case reports all schedules; PipeMesh is no slower than either, the limit no slower than it."""
    case = StudyCase("GPT-tiny", ModelSpec(8, 1024, 8, 1024, 1), tp=1, pp=2, vpp=2, dp=2, microbatches=4)
    row = run_case(case, gbps=10, memory_gb=40)
    assert row["depth-first"] and row["breadth-first"] and row["pipemesh"]
    assert row["pipemesh"]["iteration_s"] <= min(row["depth-first"]["iteration_s"], row["breadth-first"]["iteration_s"]) + 1e-12
    assert row["limit_iteration_s"] <= row["pipemesh"]["iteration_s"]
    table = markdown([row])
    assert "GPT-tiny" in table and "x |" in table
