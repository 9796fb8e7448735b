"""How each job runs: ``<job>.py`` defines ``run(ws) -> JobOutput`` on a loaded workspace. What a
job is (its recipe model, card part, plan lines) is declared in `hf_rebasin.recipe.jobs`; the
pipeline imports a job's module here by name when it runs (`run.pipeline.run_job`)."""
