"""A search agent in the ASearcher style: over a small local corpus (generated in code from a seed,
nothing shipped), the model searches (``<search>query</search>``), opens pages (``<open>page id</open>``)
and answers (``<answer>text</answer>``), one tool call per turn, for many turns; scored by exact match
and token F1.

- ``corpus``: fictional people, cities, countries and companies, their pages, and multi-hop questions
  over them (``write_dataset(folder)`` writes the JSONL files ``dataset.task=custom`` reads);
- ``index``: a BM25 index of the corpus (``search``, ``open_page``);
- ``workflow``: ``SearchAgentWorkflow`` (the built-in workflow ``search``);
- ``reward``: ``exact_match_f1`` (``reward.fn: areal_hpc.agents.search.reward:exact_match_f1``).

Importing this package imports nothing else: the reward's worker processes load only ``reward``.
"""
