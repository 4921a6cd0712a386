"""Tests of ``areal_hpc/algo/`` (floor 3): advantages, losses, packing, prefix trees and their balance."""
