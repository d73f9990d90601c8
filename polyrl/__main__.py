from polyrl.cli import main

raise SystemExit(main())
