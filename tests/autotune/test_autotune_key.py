"""Keys: size bucketing, string round trip, device slugs."""
import pytest

from kvtier.autotune.key import DeviceId, TuneKey, rows_bucket, versions


@pytest.mark.parametrize("n,bucket", [(0, 1), (1, 1), (2, 2), (3, 4), (4, 4), (5, 8), (1000, 1024),
                                      (1024, 1024), (1025, 2048)])
def test_rows_bucket_is_the_power_of_two_at_or_above(n, bucket):
    assert rows_bucket(n) == bucket


def test_key_buckets_rows_and_round_trips_through_its_string():
    k = TuneKey.of("backup", row_bytes=656, page_size=64, num_rows=3000, num_layers=61, crosses_link=True)
    assert (k.op, k.crosses_link, k.row_bytes, k.page_size, k.rows_bucket, k.num_layers) == \
        ("backup", True, 656, 64, 4096, 61)
    assert TuneKey.from_str(k.to_str()) == k
    # Every field is part of the key.
    others = [TuneKey.of("load", row_bytes=656, page_size=64, num_rows=3000, num_layers=61, crosses_link=True),
              TuneKey.of("backup", row_bytes=576, page_size=64, num_rows=3000, num_layers=61, crosses_link=True),
              TuneKey.of("backup", row_bytes=656, page_size=1, num_rows=3000, num_layers=61, crosses_link=True),
              TuneKey.of("backup", row_bytes=656, page_size=64, num_rows=5000, num_layers=61, crosses_link=True),
              TuneKey.of("backup", row_bytes=656, page_size=64, num_rows=3000, num_layers=1, crosses_link=True),
              TuneKey.of("backup", row_bytes=656, page_size=64, num_rows=3000, num_layers=61, crosses_link=False)]
    assert len({k.to_str(), *(o.to_str() for o in others)}) == 7


def test_device_slug_is_file_name_safe():
    d = DeviceId("cuda", "NVIDIA H200 / PCIe:0", "sm_90", 132)
    assert d.slug() == "cuda-NVIDIA_H200___PCIe_0"


def test_versions_name_triton_and_kvtier():
    v = versions()
    assert set(v) == {"triton", "kvtier"} and all(isinstance(x, str) and x for x in v.values())
