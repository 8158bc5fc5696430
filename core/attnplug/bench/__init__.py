"""``attnplug bench``'s machinery: what a sweep is (``spec``), one paged problem and its two
baselines (``problem``), timing and read bandwidth (``timing``), running a sweep (``runner``),
its table and JSON (``report``) and its PNG (``plot``).

Importing this package imports nothing heavy: torch is imported by ``problem``,
``timing`` and ``runner`` only when a sweep runs (``attnplug list`` builds every
subcommand's parser, ``bench`` included).
"""
