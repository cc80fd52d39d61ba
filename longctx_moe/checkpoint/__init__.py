"""Checkpoints: atomic, durable, verified, and readable under any parallel layout.

Layout under the checkpoint directory:

    step_00000100/            one directory per saved step
        meta.json             step, world size, the model/parallel config it was written with,
                              each rank file's size and sha256, and the index of every tensor:
                              its global shape, dtype and pieces (file, offsets, shape)
        rank_00000.safetensors ...  the pieces each rank wrote; its metadata holds the rank's
                              own state (RNG, loader position) as JSON
    latest                    text file naming the newest complete step directory
    superseded/step_...       steps set aside by a run that went back to an earlier step

Tensors are stored by global slice (sharded_state.py says which slice a rank holds), each piece
once: a piece that several ranks hold alike (replicas over DP, CP, ...) is written by the lowest
of them. A run under another layout (world size, TP, CP, EP) reads the slices it needs from
whichever files hold them (`reader.CheckpointReader`). No pickles: safetensors and
JSON only.

A save has three parts: `stage_checkpoint` (collective: the temporary directory, who writes which
piece), `write_staged` (this rank's file into `.step_N.tmp/`, fsynced; no collective, so
`AsyncSave` runs it on a background thread from copies of the tensors) and `publish_checkpoint`
(collective: once every rank has reported success, rank 0 writes meta.json, fsyncs the directory,
renames it into place, fsyncs the parent and replaces `latest`). A crash or a power cut therefore
never leaves a half-written step that `latest` names. Assumes a filesystem that every rank sees
(one machine, or a shared mount).

A step is complete when its meta.json is readable and every file it lists is there at its
recorded size. Resume (`find_resume_dir`) takes the step `latest` names. When `latest` is missing,
or names a step that is gone or not complete (a crash between the rename and `latest`, a kill
while pruning, a file deleted or cut short), it falls back to the newest complete step with a
one-line notice naming each step it skips. Pruning deletes a step's meta.json first, so a kill
part-way through never leaves a candidate. A rank file at its size that fails its checksum is a
storage fault: loading stops with one line naming the file and the older step to use, rather
than silently throwing away progress.

A run that goes back to an earlier step (`checkpoint.resume=none` in a used directory, or a step
directory given by path) owns the steps after it no more: they are moved to `superseded/`
(replacing a same-named one there), never deleted, and `latest` stops naming them. So pruning to
the newest `keep_last` steps by number never deletes the step just written, and the next resume
loads what `latest` names. Delete `superseded/` by hand once it is not wanted.

Save and resume are collectives that agree before moving on (`agree`): one rank's failure (a
corrupt file, a full disk) makes every rank raise the same one-line CheckpointError, instead of
leaving its peers blocked in the next collective.

Modules, one job each:

    steps.py          the checkpoint directory: step names, meta.json, which steps are complete,
                      `latest`, pruning, setting aside, and which step a resume takes
    rank_file.py      one rank's safetensors file: written and read with its sha256 computed alongside
    durable.py        fsynced files and directories
    save.py           a save: stage (collective), write (any thread), publish (collective)
    reader.py         `CheckpointReader`: any slice of any tensor from a step, whatever layout wrote it
    sharded_state.py  the trainer's tensors by global slice (read from the modules' declarations)
    trainer_state.py  saving and loading a Trainer, its loader position and RNG; `Checkpointer`
    resume.py         the resume rules a run applies at start-up
    errors.py         CheckpointError, and `agree`: every rank raises the same error or none does
    rng.py            every RNG stream as JSON
"""
