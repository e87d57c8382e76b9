"""Imported last by a fork server (`daemons.forking.start`): its preloaded modules' objects are
frozen (`daemons.heap.settle`), so the workers forked from it never walk or copy them."""

from daemons.heap import settle

settle()
