"""rayeval's environment variables (rayeval.config.constants) read as their comments say."""
import pytest


def test_the_data_stages_bound_comes_from_the_environment(monkeypatch):
    from rayeval.config import constants

    monkeypatch.delenv("RAYEVAL_DATA_CONCURRENCY", raising=False)
    assert constants.data_concurrency() is None
    monkeypatch.setenv("RAYEVAL_DATA_CONCURRENCY", " 3 ")
    assert constants.data_concurrency() == 3
    for bad in ("0", "-1", "two", "1.5"):
        monkeypatch.setenv("RAYEVAL_DATA_CONCURRENCY", bad)
        with pytest.raises(ValueError, match=rf"^RAYEVAL_DATA_CONCURRENCY={bad!r}: expected"):
            constants.data_concurrency()
