import pytest

from pipeplan.units import format_bytes, format_ms, parse_bandwidth, parse_bytes, parse_duration_ms


@pytest.mark.parametrize(
    "text,expected", [("16 GiB", 16 * 2**30), ("512MB", 512 * 10**6), ("100 B", 100), ("1.5 KiB", 1536)]
)
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize(
    "text,expected", [("10 Gbit/s", 1.25e9), ("25 GB/s", 25e9), ("800 Mbit/s", 1e8), ("1 MiB/s", 2**20)]
)
def test_parse_bandwidth(text, expected):
    assert parse_bandwidth(text) == pytest.approx(expected)


def test_parse_duration():
    assert parse_duration_ms("5 us") == pytest.approx(0.005)
    assert parse_duration_ms("2 s") == 2000.0


@pytest.mark.parametrize("bad", ["16 gib", "10 Gbps", "GB", "ten GB", 16, "1 GiB/s/s"])
def test_bad_units_name_the_text(bad):
    with pytest.raises(ValueError) as info:
        parse_bytes(bad)
    assert str(bad)[:2] in str(info.value)


def test_format():
    assert format_bytes(3 * 2**30) == "3.00 GiB"
    assert format_bytes(300) == "300 B"
    assert format_ms(1500) == "1.5 s"
    assert format_ms(12.34) == "12.3 ms"
