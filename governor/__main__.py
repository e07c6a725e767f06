from governor.shell.cli import main

raise SystemExit(main())
