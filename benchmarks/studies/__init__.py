"""Results written from finished runs and studies, so that no number in RESULTS.md is copied by hand: a recipe run's
(`recipe_results`), a downstream study's (`downstream_results`), a study re-reported with the report's statistics
(`rereport`), MQAR learning curves (`mqar_curve`), the GPU training paths' loss curves measured on a CPU
(`cpu_curves`) and the kill rate of a mutation-testing run (`mutation_report`).
Each is run as `python -m benchmarks.studies.<name>`; importing this package imports none of them.
"""
