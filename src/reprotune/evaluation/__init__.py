"""The eval stage's parts (reprotune.evaluate is the stage: settings -> data -> passes -> score -> report):
`holdout` reads the examples, `generation` runs the local systems (base, the SFT start adapter, tuned), `baseline`
the prompt-only endpoint, `scoring` settles the task and scores every system, `report` writes the output set,
`preference_pass` adds a preference run's pairs."""
