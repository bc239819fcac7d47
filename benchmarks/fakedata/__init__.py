"""Tiny, deterministic stand-ins for published datasets, written in their real on-disk formats.

Everything here is a pure function of its arguments (including ``seed``): the same call writes byte-identical
files, so tests can pin checksums. Archives are made reproducible by zeroing every timestamp/owner field
(gzip ``mtime=0``; tar ``mtime=0``, ``uid/gid=0``, empty user/group names; zip dates fixed at 1980-01-01) and by
adding members in sorted order.

    mnist             MNIST's four gzipped IDX files (``mnist_files``)
    cifar             the CIFAR-10 and CIFAR-100 python archives (``cifar_archive``)
    imagefolder       a folder of noise images per class (``imagefolder_tree``)
    archives          a folder packed into a reproducible tar.gz or zip (``pack``), and the tar/zip entries
    hostile_archives  archives whose members try to leave the extraction folder (``tar_with_member``, ...)
    labels            CIFAR's published class names; labels that cycle through every class
    files             files written whole, gzip without a timestamp, md5 and sha256 digests
"""
