from polyrl.launch import die_with_launcher

die_with_launcher()  # a rank of a launch ends with its launcher, armed before the seconds of imports below

from polyrl.cli import main  # noqa: E402

raise SystemExit(main())
