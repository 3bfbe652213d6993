"""A model handed to EngineCore by a test or bench names its path as a plain string."""

from service.model.pooling import Pooling, from_checkpoint


def test_a_path_given_as_a_string_that_is_no_checkpoint_pools_nothing():
    assert from_checkpoint("random") == Pooling()
