"""PagePool bookkeeping and its integrity check."""

import pytest

from mili.cache.page_pool import OutOfPages, PagePool


def test_allocate_share_and_free():
    pool = PagePool(8, 16)
    a = pool.allocate(3)
    b = pool.allocate(2)
    assert pool.num_free == 3 and len(set(a + b)) == 5
    pool.incref(a[:2])  # a second holder shares two pages
    shared = a[:2]
    pool.check_integrity([a, b, shared])
    pool.decref(a)
    assert pool.num_free == 4  # a[2] freed, the shared two still held
    pool.check_integrity([b, shared])
    pool.decref(shared + b)
    assert pool.num_free == 8
    pool.check_integrity([])


def test_out_of_pages_and_integrity_violations():
    pool = PagePool(4, 16)
    pages = pool.allocate(4)
    with pytest.raises(OutOfPages):
        pool.allocate(1)
    with pytest.raises(AssertionError):
        pool.check_integrity([pages[:3]])  # a held page with no holder
    with pytest.raises(AssertionError):
        pool.check_integrity([pages, pages[:1]])  # a holder the ref count does not know
    assert pool.pages_for(0) == 0 and pool.pages_for(16) == 1 and pool.pages_for(17) == 2
