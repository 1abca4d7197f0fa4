"""graphcap inside sglang: the plugin behind `--enable-draft-graph-capture` (`plugin`, loaded through sglang's
`sglang.srt.plugins` entry point; nothing here imports sglang until sglang calls it), what it reads of sglang per
version (`compat`), its settings - the flags' options and every environment variable it reads, parsed once
(`settings`) - its flags, hook targets and start-up check (`config`), the hooks on sglang's classes (`hooks`), the
draft runtime per worker (`runtime`: slots, loop, head, linear, trace) and the target verify's attention seat
(`verify`)."""
